//! The vovp wire protocol, version [`VERSION`] ([PROTOCOL.md](../../../PROTOCOL.md) is its
//! specification), with no I/O: the frame header, the field encoding, and every message as a
//! type whose `encode` and `decode` sit side by side: [`Request`] (client to daemon),
//! [`Reply`] (daemon to client, decoded by the opcode it answers) and NOTIFY frames (the
//! subscriber stream: [`decode_notification`], a `vovp_types::Notification` each). Both the
//! daemon (`vovp-transport`) and the Rust client (`vovp-client`) speak it through this crate
//! only, so a change to the wire is made once.
//!
//! What is not wire lives elsewhere: the daemon's runtime outcomes (a subscription's receiver,
//! "send no reply", the segment whose fd rides on a reply) and the client's mappings.

#![warn(unreachable_pub, missing_debug_implementations)]
// Lengths, counts and offsets come off the wire: a silent truncation is a wrong address.
// (Tests build their frames with casts at will.)
#![cfg_attr(not(test), warn(clippy::cast_possible_truncation))]
#![cfg_attr(not(test), warn(clippy::cast_sign_loss))]
#![cfg_attr(not(test), warn(clippy::cast_possible_wrap))]

mod codes;
mod error;
mod notify;
mod reply;
mod request;
pub mod transfer;
mod wire;

pub use codes::{Opcode, Status, STATUS_OK};
pub use error::DecodeError;
pub use notify::{decode_notification, encode_notification};
pub use reply::{Failure, Reply, STATS_FIELDS, STATS_FIELDS_FIRST};
pub use request::{Fetch, FetchBase, Gather, PublishItem, Request, MAX_FETCH_RANGES};
pub use wire::{FrameWriter, Header, Reader};
// The wire's limits are defined with every other limit, in `vovp-types`.
pub use vovp_types::wire::{
    LIST_PAGE_BYTES, LIST_PAGE_ENTRIES, MAX_GET_NAMES, MAX_LIST_PAGE_ENTRIES, MAX_PAYLOAD,
    MAX_PUBLISH_MANY,
};

/// The protocol version in every frame header (and in HELLO's reply).
/// 2: versions (an objref's, LIST's and NOTIFY's `version`, SEAL's reply, GET_NEWER, the
/// REPLACE flag).
pub const VERSION: u8 = 2;
/// Bytes of the frame header: `u32 length, u8 version, u8 opcode, u16 flags, u64 request_id`.
pub const HEADER_LEN: usize = 16;
/// Bytes of a frame after its length field, besides the payload.
pub const LENGTH_OVERHEAD: u32 = 12;
/// Largest PUT payload the daemon accepts (bigger objects: CREATE, write the mapping, SEAL): the
/// store's limit, [`vovp_types::MAX_INLINE_PUT`].
#[allow(clippy::cast_possible_truncation)] // 1 MiB: checked just below
pub const MAX_INLINE: u32 = vovp_types::MAX_INLINE_PUT as u32;
const _: () = assert!(vovp_types::MAX_INLINE_PUT <= u32::MAX as usize);
/// Header flag: send no reply (RELEASE only).
pub const FLAG_NO_REPLY: u16 = 1;
/// A reply's opcode is its request's with this bit set.
pub const REPLY_BIT: u8 = 0x80;
/// `next` of the last LIST page.
pub const LIST_END: u64 = u64::MAX;
/// CREATE and PUT flag: delete the object at its last release after seal.
pub const CREATE_EPHEMERAL: u32 = 1;
/// PUT flag: the putter keeps one reference to the sealed object.
pub const PUT_KEEP_REFERENCE: u32 = 2;
/// PUT flag: sent without waiting for the reply, after the client counted it in its hold
/// table's `puts_sent` (vovp-shm's `sent`): the store counts it applied, whatever the outcome.
pub const PUT_PIPELINED: u32 = 4;
/// CREATE, PUT and PUBLISH flag: the name may refer to a sealed object already; this one
/// becomes the name's next version at its seal (without the flag: ALREADY_EXISTS).
pub const CREATE_REPLACE: u32 = 8;
/// CREATE, PUT and PUBLISH flag: a `u64 version` follows the flags, the exact version the
/// object seals as (above the name's present one, else STALE_VERSION). Set by the encoder from
/// the request's `version`; decoded requests carry it there, not in `flags`.
pub const PUT_VERSION: u32 = 16;
/// LEND flag: the small-object lend, for objects published without waiting for the reply
/// (a put that returns the store's copy at once). Apart from the big lend, so small objects
/// never pin a big one; small itself (64 KiB), never taken back.
pub const LEND_SMALL: u32 = 1;

/// The CREATE, PUT and PUBLISH flags of `options`: the one mapping from the options a caller
/// gives to the wire (a CREATE's device is a field of its own; a CREATE sends the first two
/// flags only, see [`create_flags`]).
pub fn put_flags(options: &vovp_types::PutOptions) -> u32 {
    let mut flags = create_flags(options);
    if options.keep_reference {
        flags |= PUT_KEEP_REFERENCE;
    }
    if options.pipelined {
        flags |= PUT_PIPELINED;
    }
    flags
}

/// The flags a CREATE of `options` sends: [`CREATE_EPHEMERAL`] and [`CREATE_REPLACE`] (a create
/// keeps its reference and waits for its reply whatever the options say).
pub fn create_flags(options: &vovp_types::PutOptions) -> u32 {
    let mut flags = 0;
    if options.ephemeral {
        flags |= CREATE_EPHEMERAL;
    }
    if options.replace {
        flags |= CREATE_REPLACE;
    }
    flags
}

/// The options a PUT's or PUBLISH's `flags` ask for (`device`: `None`, host bytes; a
/// CREATE's: see [`create_options`]): [`put_flags`] read back. Unknown bits are ignored.
pub fn put_options(flags: u32, device: Option<vovp_types::Device>) -> vovp_types::PutOptions {
    vovp_types::PutOptions {
        ephemeral: flags & CREATE_EPHEMERAL != 0,
        device,
        replace: flags & CREATE_REPLACE != 0,
        keep_reference: flags & PUT_KEEP_REFERENCE != 0,
        pipelined: flags & PUT_PIPELINED != 0,
        version: None,
    }
}

/// The options a CREATE's `flags` and `device` ask for: [`create_flags`] read back (a create
/// keeps its reference and waits for its reply whatever other bits say).
pub fn create_options(flags: u32, device: vovp_types::Device) -> vovp_types::CreateOptions {
    put_options(flags, Some(device)).with(false, false)
}

/// Bytes one LIST entry takes on the wire (what [`Reply::List`] encodes per entry), so the
/// daemon can cut a page at [`LIST_PAGE_BYTES`] before encoding it.
pub fn list_entry_bytes(i: &vovp_types::ObjectInfo) -> usize {
    2 + i.name.as_str().len() + 8 + 8 + 1 + 4 + 1 + 1 + 4 + 8 + 4 + i.metadata.len() + 8
}
