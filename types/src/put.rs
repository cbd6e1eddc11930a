//! How a put is made, decided once for every entry point: [`PutOptions`], the one spelling of
//! what a caller asks of a put or a create, and [`route`], the one decision of which way a put
//! goes. The decision is sans I/O: it reads the sizes, the options and what the connection
//! offers now ([`PutPaths`]), and the caller (the blocking and async clients, the embedded
//! engine, the Python core) carries the route out.
//!
//! The routes, cheapest first (the lends: `vovp-client`'s `lent`, `vovp_shm::lend`; pipelined
//! puts: `vovp_shm::sent`):
//! * [`Route::Lend`] / [`Route::LendPipelined`]: objects from [`lends::MIN_OBJECT`] up to the
//!   lend's largest are copied into the client's own lend and made an object by one PUBLISH
//!   (no CREATE, no bytes through the socket); a kept put may return before its answer.
//! * [`Route::SmallLend`]: a kept put that may return before its answer and takes at most
//!   [`lends::SMALL_MAX_BLOCK`] goes into the small lend (batches share one PUBLISH_MANY).
//! * [`Route::Inline`] / [`Route::InlinePipelined`]: up to the inline limit the bytes ride in
//!   the request (PUT; the embedded engine's one message); a put that keeps no reference may
//!   be sent without waiting for its answer.
//! * [`Route::CreateCopySeal`]: everything else: CREATE, a (parallel) copy into the mapping,
//!   SEAL.
//!
//! A route that turns out not to work when tried (the lend busy or taken back, no small lend
//! to be had, this client's own put of the name still unanswered) is not an error: the caller
//! takes that way out of its [`PutPaths`] ([`PutPaths::without`]) and decides again, so every
//! fallback is the same decision with one way fewer.

use crate::lends;
use crate::{Device, Error};

/// What a caller asks of a put (and of a create, which takes the first three: see
/// [`CreateOptions`](crate::CreateOptions)). The wire carries the four flags (vovp-proto's
/// `put_flags` / `put_options`, the only mapping), the embedded engine's session takes it as it
/// is.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PutOptions {
    /// Delete the object as soon as its last reference is released (after seal).
    pub ephemeral: bool,
    /// Host memory unless a CUDA device is named (a put copies host bytes: device objects are
    /// created, then written).
    pub device: Option<Device>,
    /// The name may already refer to a sealed object: this one takes the name over at its
    /// seal, as the name's next version (without it, a taken name is `AlreadyExists`).
    pub replace: bool,
    /// Keep the creator's reference: the put answers with the store's copy, a view. The
    /// entry points named for what they return set it themselves (`Store::put` keeps none,
    /// `put_and_view` keeps one).
    pub keep_reference: bool,
    /// The put may return before the store's answer (sent without waiting for the reply,
    /// counted in the connection's hold table first; a failure is reported by the client's
    /// `sync`). On the store's side: the client sent it so. Where the connection cannot
    /// (opted out, no hold table, a forked child) the put waits anyway.
    pub pipelined: bool,
    /// Seal the object as exactly this version of its name instead of the next one, which
    /// must be above the name's version at the seal (else [`Error::StaleVersion`]; 0 is
    /// refused). How a node's store keeps the version a cluster gave a name, so that
    /// `get_newer` and `version_of` speak the cluster's numbers. `None`: the next version
    /// (1 for a free name).
    pub version: Option<u64>,
}

impl PutOptions {
    /// Whether the object goes into host memory.
    pub fn on_host(&self) -> bool {
        matches!(self.device, None | Some(Device::Cpu))
    }

    /// These options with the reference kept (or not) and the answer awaited (or not): what
    /// an entry point named for its result sets.
    pub fn with(self, keep_reference: bool, pipelined: bool) -> Self {
        PutOptions {
            keep_reference,
            pipelined,
            ..self
        }
    }

    /// These options sealing as exactly `version` (see [`PutOptions::version`]).
    pub fn at_version(self, version: u64) -> Self {
        PutOptions {
            version: Some(version),
            ..self
        }
    }
}

/// The ways a put may go on one connection now, as its client knows them (the embedded
/// engine's: [`PutPaths::EMBEDDED`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PutPaths {
    /// Largest data sent inside the request (a socket client: the daemon's `max_inline`, at
    /// most [`crate::CLIENT_INLINE_PUT`]; the embedded engine: [`crate::INLINE_PUT_LIMIT`]).
    pub inline_limit: usize,
    /// Puts may be sent without waiting for their answer: a hold table to count them in
    /// that this process may write (not a forked child's), and the client did not opt out.
    pub pipelining: bool,
    /// The largest block (data padded, then metadata: [`lends::block_len`]) this client's
    /// lend takes; `None`: no lend (opted out, a store that lends nothing, no hold table, a
    /// forked child, the lend busy).
    pub lend: Option<u64>,
    /// The small lend may be used (it also needs [`PutPaths::pipelining`]).
    pub small_lend: bool,
}

impl PutPaths {
    /// The embedded engine: one message up to [`crate::INLINE_PUT_LIMIT`], else create, copy
    /// and seal; no lends, nothing pipelined (a call in-process waits for nothing).
    pub const EMBEDDED: PutPaths = PutPaths {
        inline_limit: crate::INLINE_PUT_LIMIT,
        pipelining: false,
        lend: None,
        small_lend: false,
    };

    /// These paths without the way `route` needs: what is left once it did not work.
    /// [`Route::Inline`] and [`Route::CreateCopySeal`] always conclude, so they take nothing.
    pub fn without(self, route: Route) -> Self {
        match route {
            Route::Lend => PutPaths { lend: None, ..self },
            // A kept put that cannot go out without waiting now waits (through the lend if
            // it still takes it).
            Route::LendPipelined | Route::InlinePipelined => PutPaths {
                pipelining: false,
                ..self
            },
            Route::SmallLend => PutPaths {
                small_lend: false,
                ..self
            },
            Route::Inline | Route::CreateCopySeal => self,
        }
    }
}

/// Which way a put goes (see the module doc).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Route {
    /// The bytes in the request (PUT), its answer awaited.
    Inline,
    /// The bytes in the request, sent without waiting for the answer (keeps no reference).
    InlinePipelined,
    /// Copied into this client's lend, one PUBLISH, its answer awaited.
    Lend,
    /// Copied into the lend, the PUBLISH sent without waiting (kept puts only: the kept
    /// reference is what keeps the lend from emptying while the answer is owed).
    LendPipelined,
    /// Copied into the small lend, PUBLISH (a batch: PUBLISH_MANY) sent without waiting
    /// (kept puts only).
    SmallLend,
    /// CREATE, copy into the mapping, SEAL.
    CreateCopySeal,
}

impl Route {
    /// Whether the put returns before the store's answer.
    pub fn is_pipelined(self) -> bool {
        matches!(
            self,
            Route::InlinePipelined | Route::LendPipelined | Route::SmallLend
        )
    }
}

/// The way a put of `size` data bytes and `metadata_len` metadata bytes with `options` goes on
/// a connection offering `paths`. A device object is no put: [`Error::Gpu`] (create it on the
/// device and write it there).
pub fn route(
    size: usize,
    metadata_len: usize,
    options: &PutOptions,
    paths: &PutPaths,
) -> Result<Route, Error> {
    if !options.on_host() {
        return Err(Error::Gpu(
            "put copies host bytes; create a device object and copy into it instead".into(),
        ));
    }
    let block = lends::block_len(size as u64, metadata_len as u64);
    let kept_later = options.keep_reference && options.pipelined && paths.pipelining;
    let fits_lend = size >= lends::MIN_OBJECT
        && paths
            .lend
            .zip(block)
            .is_some_and(|(largest, need)| need <= largest);
    if fits_lend {
        return Ok(if kept_later {
            Route::LendPipelined
        } else {
            Route::Lend
        });
    }
    if kept_later && paths.small_lend && block.is_some_and(|b| b <= lends::SMALL_MAX_BLOCK) {
        return Ok(Route::SmallLend);
    }
    if size <= paths.inline_limit {
        let later = options.pipelined && !options.keep_reference && paths.pipelining;
        return Ok(if later {
            Route::InlinePipelined
        } else {
            Route::Inline
        });
    }
    Ok(Route::CreateCopySeal)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lends::{MIN_OBJECT, SMALL_MAX_BLOCK};
    use crate::CLIENT_INLINE_PUT;

    const KIB: usize = 1024;
    const MIB: usize = 1 << 20;

    /// A socket client of a 1 GiB store with everything on: lends of 16 MiB take 4 MiB.
    fn client() -> PutPaths {
        PutPaths {
            inline_limit: CLIENT_INLINE_PUT,
            pipelining: true,
            lend: Some(4 * MIB as u64),
            small_lend: true,
        }
    }

    fn raw() -> PutOptions {
        PutOptions::default().with(false, true)
    }
    fn waiting() -> PutOptions {
        PutOptions::default().with(false, false)
    }
    fn kept() -> PutOptions {
        PutOptions::default().with(true, false)
    }
    fn kept_later() -> PutOptions {
        PutOptions::default().with(true, true)
    }

    fn way(size: usize, options: PutOptions, paths: PutPaths) -> Route {
        route(size, 0, &options, &paths).unwrap()
    }

    #[test]
    fn a_raw_small_put_goes_out_without_waiting_a_kept_one_into_the_small_lend() {
        assert_eq!(way(64, raw(), client()), Route::InlinePipelined);
        assert_eq!(way(64, waiting(), client()), Route::Inline);
        assert_eq!(way(64, kept(), client()), Route::Inline);
        assert_eq!(way(64, kept_later(), client()), Route::SmallLend);
        assert_eq!(way(0, kept_later(), client()), Route::SmallLend);
    }

    #[test]
    fn the_small_lend_takes_blocks_up_to_its_largest_data_and_metadata_together() {
        let exact = SMALL_MAX_BLOCK as usize;
        assert_eq!(way(exact, kept_later(), client()), Route::SmallLend);
        assert_eq!(way(exact + 1, kept_later(), client()), Route::Inline);
        // 64 bytes of data and 24 of header take two lines; 4032 + 65 take 4160 > 4096.
        let with_meta = |size, meta| route(size, meta, &kept_later(), &client()).unwrap();
        assert_eq!(with_meta(64, 24), Route::SmallLend);
        assert_eq!(with_meta(exact - 64, 64), Route::SmallLend);
        assert_eq!(with_meta(exact - 64, 65), Route::Inline);
    }

    #[test]
    fn the_lend_takes_objects_from_its_smallest_to_its_largest() {
        for options in [raw(), waiting(), kept()] {
            assert_eq!(
                way(MIN_OBJECT - 1, options, client()),
                Route::Inline.or(options)
            );
            assert_eq!(way(MIN_OBJECT, options, client()), Route::Lend);
            assert_eq!(way(4 * MIB, options, client()), Route::Lend);
            assert_eq!(way(4 * MIB + 1, options, client()), Route::CreateCopySeal);
        }
        assert_eq!(
            way(MIN_OBJECT, kept_later(), client()),
            Route::LendPipelined
        );
        assert_eq!(way(4 * MIB, kept_later(), client()), Route::LendPipelined);
        // Data padded to 64 bytes, then the metadata: one byte of metadata is one line more.
        let largest = |meta| route(4 * MIB - 64, meta, &kept(), &client()).unwrap();
        assert_eq!(largest(64), Route::Lend);
        assert_eq!(largest(65), Route::CreateCopySeal);
    }

    impl Route {
        /// What a small put that keeps nothing and may pipeline becomes instead of `self`.
        fn or(self, options: PutOptions) -> Route {
            if options.pipelined && !options.keep_reference {
                Route::InlinePipelined
            } else {
                self
            }
        }
    }

    #[test]
    fn inline_up_to_the_limit_then_create_copy_seal() {
        let no_lend = PutPaths {
            lend: None,
            ..client()
        };
        assert_eq!(
            way(CLIENT_INLINE_PUT, raw(), no_lend),
            Route::InlinePipelined
        );
        assert_eq!(way(CLIENT_INLINE_PUT, kept(), no_lend), Route::Inline);
        assert_eq!(
            way(CLIENT_INLINE_PUT + 1, raw(), no_lend),
            Route::CreateCopySeal
        );
        // A daemon announcing a smaller max_inline is the limit.
        let small = PutPaths {
            inline_limit: 1000,
            ..no_lend
        };
        assert_eq!(way(1000, waiting(), small), Route::Inline);
        assert_eq!(way(1001, waiting(), small), Route::CreateCopySeal);
    }

    #[test]
    fn lends_off_small_and_big_go_the_waiting_ways() {
        // Opted out, a store that lends nothing, no hold table, a forked child: no lend, and
        // (no table to count in) nothing pipelined.
        let off = PutPaths {
            inline_limit: CLIENT_INLINE_PUT,
            pipelining: false,
            lend: None,
            small_lend: false,
        };
        assert_eq!(way(64, raw(), off), Route::Inline);
        assert_eq!(way(64, kept_later(), off), Route::Inline);
        assert_eq!(way(MIN_OBJECT, kept_later(), off), Route::Inline);
        assert_eq!(way(MIB, raw(), off), Route::CreateCopySeal);
        // Lends on but pipelining off (`no_pipelined_puts`): the lend, waiting.
        let waits = PutPaths {
            lend: Some(4 * MIB as u64),
            ..off
        };
        assert_eq!(way(MIB, kept_later(), waits), Route::Lend);
        // Pipelining on but the small lend refused: a kept small put waits.
        let no_small = PutPaths {
            small_lend: false,
            ..client()
        };
        assert_eq!(way(64, kept_later(), no_small), Route::Inline);
        assert_eq!(way(64, raw(), no_small), Route::InlinePipelined);
    }

    #[test]
    fn a_way_that_did_not_work_falls_back_to_the_next() {
        let paths = client();
        // The lend busy (or taken back): inline, or create.
        let r = way(MIB, kept(), paths);
        assert_eq!(r, Route::Lend);
        assert_eq!(way(MIB, kept(), paths.without(r)), Route::CreateCopySeal);
        assert_eq!(way(MIN_OBJECT, kept(), paths.without(r)), Route::Inline);
        // A kept put that could not go out without waiting waits, through the lend first.
        let r = way(MIB, kept_later(), paths);
        assert_eq!(r, Route::LendPipelined);
        let paths = paths.without(r);
        assert_eq!(way(MIB, kept_later(), paths), Route::Lend);
        assert_eq!(
            way(MIB, kept_later(), paths.without(Route::Lend)),
            Route::CreateCopySeal
        );
        // No small lend: inline, waiting.
        let r = way(64, kept_later(), client());
        assert_eq!(way(64, kept_later(), client().without(r)), Route::Inline);
        // Own put of the name unanswered: the waiting PUT.
        let r = way(64, raw(), client());
        assert_eq!(way(64, raw(), client().without(r)), Route::Inline);
        // The ways that conclude take nothing away.
        assert_eq!(client().without(Route::Inline), client());
        assert_eq!(client().without(Route::CreateCopySeal), client());
    }

    #[test]
    fn the_embedded_engine_puts_inline_then_creates() {
        let e = PutPaths::EMBEDDED;
        assert_eq!(way(crate::INLINE_PUT_LIMIT, raw(), e), Route::Inline);
        assert_eq!(
            way(crate::INLINE_PUT_LIMIT + 1, raw(), e),
            Route::CreateCopySeal
        );
        assert_eq!(way(MIN_OBJECT, kept_later(), e), Route::Inline);
        assert_eq!(way(64 * KIB, kept_later(), e), Route::Inline);
    }

    #[test]
    fn device_objects_are_no_put() {
        let cuda = PutOptions {
            device: Some(Device::Cuda(0)),
            ..raw()
        };
        assert!(matches!(route(64, 0, &cuda, &client()), Err(Error::Gpu(_))));
        let cpu = PutOptions {
            device: Some(Device::Cpu),
            ..raw()
        };
        assert_eq!(
            route(64, 0, &cpu, &client()).unwrap(),
            Route::InlinePipelined
        );
    }

    #[test]
    fn sizes_past_the_address_space_create() {
        // A block length that overflows takes no lend and no small lend.
        let huge = usize::MAX - 10;
        assert_eq!(way(huge, kept_later(), client()), Route::CreateCopySeal);
    }

    #[test]
    fn pipelined_routes_say_so() {
        let later = [
            Route::InlinePipelined,
            Route::LendPipelined,
            Route::SmallLend,
        ];
        for r in later {
            assert!(r.is_pipelined());
        }
        for r in [Route::Inline, Route::Lend, Route::CreateCopySeal] {
            assert!(!r.is_pipelined());
        }
    }
}
