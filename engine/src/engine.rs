//! `Engine::spawn`: the store in-process. Spawns the allocator, eviction/refcount and GPU actors
//! (on a private runtime thread, or on the caller's runtime for the daemon) and hands out
//! cheap, thread-safe [`EngineHandle`]s. Everything reaches the actors through a
//! [`Session`]; the actors and their messages are this crate's private core.

use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use kameo::actor::{ActorRef, Spawn};
use kameo::mailbox;
use tokio::sync::oneshot;
use vovp_actors::gpu::GpuActor;
use vovp_actors::table_actor::ObjectTableActor;
use vovp_actors::AllocatorActor;
use vovp_actors::Segment;
use vovp_actors::SharedConfig;
use vovp_shm::held::{self, DirectoryPart};
use vovp_shm::SharedReader;
use vovp_types::put::{self, PutPaths, Route};
use vovp_types::{CreateOptions, HolderId, ObjectInfo, StoreStats};

use crate::core::{block_on, Core, EngineActors};
use crate::session::Session;
use crate::{Config, Error, ObjectBuffer, ObjectView};
use vovp_types::{AsyncStore, Store};

/// The in-process store.
#[derive(Debug)]
pub struct Engine;

impl Engine {
    /// Starts an engine on its own runtime thread. Usable from any thread (blocking [`Store`])
    /// and from any async runtime ([`AsyncStore`]).
    pub fn spawn(config: Config) -> Result<EngineHandle, Error> {
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop_tx, stop_rx) = oneshot::channel::<()>();
        let thread = runtime_thread("vovp-engine", "engine", move |rt| {
            let rt = match rt {
                Ok(rt) => rt,
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                    return;
                }
            };
            rt.block_on(async move {
                let started = Engine::start(config).await;
                let ok = started.is_ok();
                let _ = ready_tx.send(started);
                if ok {
                    let _ = stop_rx.await;
                }
            });
        })?;
        let handle = ready_rx
            .recv()
            .map_err(|_| Error::Internal("engine thread died while starting".into()))??;
        *handle
            .session
            .core()
            .runtime
            .lock()
            .map_err(|_| Error::Internal("poisoned".into()))? = Some((thread, stop_tx));
        Ok(handle)
    }

    /// Starts an engine's actors on the current tokio runtime (the daemon runs them on its
    /// io_uring runtime, next to the connections, so no message crosses threads).
    pub async fn start(config: Config) -> Result<EngineHandle, Error> {
        if config.capacity < 4096 {
            return Err(Error::Config(format!(
                "capacity of {} bytes is too small (at least 4096)",
                config.capacity
            )));
        }
        if let Some(room) = crate::available_memory() {
            if config.capacity > room {
                let why = format!(
                    "a capacity of {} bytes is more than this machine can back now ({room} \
                     bytes available, counting swap and the memory cgroup's limit); objects \
                     past that would fail with SIGBUS when first touched",
                    config.capacity
                );
                if !config.overcommit {
                    return Err(Error::Config(format!(
                        "{why}. Use less memory, or allow it explicitly (--overcommit, \
                         Config::overcommit)"
                    )));
                }
                tracing::warn!("{why}: starting anyway (--overcommit)");
            }
        }
        // Sparse past what is used: sized so that one object of the whole capacity fits even
        // after the allocator rounds it up to its bin.
        // (--prefault touches every page of it: then exactly the capacity.)
        let segment0_len = if config.prefault {
            config.capacity
        } else {
            vovp_actors::reserved_bytes(config.capacity).ok_or_else(|| {
                Error::Config(format!("capacity {} is too large", config.capacity))
            })?
        };
        let segment = Segment::create(0, segment0_len, config.huge_pages, config.prefault)?;
        let segments: Arc<[Arc<Segment>]> = Arc::from(vec![Arc::new(segment)]);
        // Arenas are not prefaulted: with --prefault every object stays in segment 0.
        let allocator = AllocatorActor::spawn(
            AllocatorActor::new(
                segments[0].clone(),
                config.capacity,
                config.max_objects,
                config.client_arenas && !config.prefault,
            )
            .with_backing(!config.lazy_pages),
        );
        let gpu = spawn_gpu_actor(config.gpu.clone())?;
        let table = ObjectTableActor::new(
            allocator.clone(),
            gpu.clone(),
            segments.clone(),
            config
                .shared_reads
                .then(|| SharedConfig::for_store(config.capacity, config.max_objects as u64)),
            config.spill.as_ref(),
            config.max_objects as usize,
        )?;
        let pipelined_puts_applied = table.pipelined_puts_applied();
        let table = ObjectTableActor::spawn_with_mailbox(table, mailbox::unbounded());
        let core = Arc::new(Core {
            actors: EngineActors {
                table,
                allocator,
                gpu,
            },
            segments,
            pipelined_puts_applied,
            next_holder: AtomicU64::new(1),
            config,
            runtime: Mutex::new(None),
        });
        Ok(EngineHandle {
            session: Session::embedded(core),
        })
    }
}

/// Runs `work` on a new thread `name` with a current-thread tokio runtime of its own (`work`
/// gets the runtime, or why there is none); `what` names the thread in the error when it
/// cannot be started.
fn runtime_thread(
    name: &str,
    what: &str,
    work: impl FnOnce(Result<tokio::runtime::Runtime, Error>) + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, Error> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| Error::Internal(format!("tokio runtime: {e}")));
            work(rt)
        })
        .map_err(|e| Error::Internal(format!("cannot start the {what} thread: {e}")))
}

/// The GPU actor gets a thread of its own: its driver calls block (the first request on a device
/// creates a context and a pool, up to about a second), and must not stall the engine's thread.
fn spawn_gpu_actor(config: vovp_actors::gpu::GpuConfig) -> Result<ActorRef<GpuActor>, Error> {
    let (tx, rx) = std::sync::mpsc::channel();
    runtime_thread("vovp-gpu", "GPU", move |rt| {
        // (No runtime: the sender drops unsent, and the caller learns the thread died.)
        let Ok(rt) = rt else { return };
        rt.block_on(async move {
            let gpu = GpuActor::spawn(GpuActor::new(config));
            let _ = tx.send(gpu.clone());
            gpu.wait_for_shutdown().await;
        });
    })?;
    rx.recv()
        .map_err(|_| Error::Internal("the GPU thread died while starting".into()))
}

/// A handle on a running engine: cheap to clone (clones share one reference holder),
/// `Send + Sync`. Use [`Store`] from threads and [`AsyncStore`] from async code: views and
/// buffers that point straight into the shared memory. [`Session`]s are the raw operations
/// underneath (object references, no mapping), for code that maps the memory elsewhere.
#[derive(Clone, Debug)]
pub struct EngineHandle {
    session: Session,
}

impl EngineHandle {
    /// A handle with its own reference holder (like a separate client connection).
    pub fn session(&self) -> EngineHandle {
        EngineHandle {
            session: Session::embedded(self.session.core().clone()),
        }
    }

    /// This handle's own session (its holder): the raw operations behind its views.
    pub fn as_session(&self) -> &Session {
        &self.session
    }

    /// A session for a client in another process that maps the store's memory itself (a
    /// daemon connection): its objects go into arenas of its own, which only it may write,
    /// and an abort frees an object's memory at once.
    pub fn client_session(&self) -> Session {
        Session::client(self.session.core().clone())
    }

    pub fn holder(&self) -> HolderId {
        self.session.holder()
    }

    pub fn segments(&self) -> &Arc<[Arc<Segment>]> {
        self.session.segments()
    }

    pub fn config(&self) -> &Config {
        self.session.config()
    }

    /// Checks the object table's invariants (for tests).
    pub async fn check_invariants(&self) -> Result<(), Error> {
        self.session.check_invariants().await
    }

    /// Stops the actors and the engine's thread. Views still alive keep their mapping; every
    /// later call fails with [`Error::ShuttingDown`].
    pub fn shutdown(&self) {
        let core = self.session.core();
        let runtime = core.runtime.lock().ok().and_then(|mut r| r.take());
        let stop = async {
            let _ = core.actors.table.stop_gracefully().await;
            core.actors.table.wait_for_shutdown().await;
            let _ = core.actors.allocator.stop_gracefully().await;
            let _ = core.actors.gpu.stop_gracefully().await;
        };
        block_on(stop);
        if let Some((thread, stop_tx)) = runtime {
            let _ = stop_tx.send(());
            let _ = thread.join();
        }
    }
}

impl AsyncStore for EngineHandle {
    async fn create(
        &self,
        name: &str,
        size: u64,
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<ObjectBuffer, Error> {
        let r = self.session.create(name, size, metadata, options).await?;
        // The buffer owns the reference from here, so an error below still releases it.
        match self.session.mapped(&r).await {
            // SAFETY: `mapped` is the session's mapping of the object it just created.
            Ok(mapped) => Ok(unsafe { ObjectBuffer::from_mapped(r, mapped, self.session.sink()) }),
            Err(e) => {
                self.session.release_later(vec![r.id]);
                Err(e)
            }
        }
    }

    async fn seal(&self, name: &str) -> Result<u64, Error> {
        self.session.seal(name).await
    }

    async fn abort(&self, name: &str) -> Result<(), Error> {
        // The caller's buffer of it may still be alive: its memory goes with the buffer.
        self.session.abort(name).await
    }

    async fn put(
        &self,
        name: &str,
        data: &[u8],
        metadata: &[u8],
        options: CreateOptions,
    ) -> Result<(), Error> {
        // The route every client takes, with the ways an in-process put has: one message up to
        // the engine's inline limit, else create, copy and seal.
        let options = options.with(false, false);
        match put::route(data.len(), metadata.len(), &options, &PutPaths::EMBEDDED)? {
            Route::CreateCopySeal => {
                vovp_shm::put::create_copy_seal_async(self, name, data, metadata, options).await
            }
            // (The only other way the embedded paths offer.)
            _ => (self.session)
                .put_inline(name, data.to_vec(), metadata, options)
                .await
                .map(drop),
        }
    }

    /// Names published in the shared directory are got with no message to the table actor (a
    /// hold in this session's table); the rest, if any, in one ask.
    async fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let reader = self.session.shared_reader().await;
        let part = DirectoryPart::look(names, |n| self.held(reader.as_ref(), n));
        let rest = part.rest();
        // On an error the views got so far drop here, releasing their holds.
        let got = match rest.is_empty() {
            true => Vec::new(),
            false => self.get_from_table(&rest, timeout).await?,
        };
        Ok(part.fill(got))
    }

    async fn get_newer(
        &self,
        name: &str,
        newer_than: u64,
        timeout: Option<Duration>,
    ) -> Result<ObjectView, Error> {
        let reader = self.session.shared_reader().await;
        if let Some(v) = held::newer(self.held(reader.as_ref(), name), newer_than) {
            return Ok(v);
        }
        self.get_from_table_newer(&[name], &[newer_than], timeout)
            .await?
            .pop()
            .flatten()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }

    async fn contains(&self, name: &str) -> Result<bool, Error> {
        self.session.contains(name).await
    }

    async fn delete(&self, name: &str) -> Result<(), Error> {
        self.session.delete(name).await
    }

    async fn list(&self) -> Result<Vec<ObjectInfo>, Error> {
        self.session.list().await
    }

    async fn evict(&self, bytes: u64) -> Result<u64, Error> {
        self.session.evict(bytes).await
    }

    async fn stats(&self) -> Result<StoreStats, Error> {
        self.session.stats().await
    }
}

impl EngineHandle {
    /// `name` through the shared directory (`reader`, this session's), with no message:
    /// `None` when the table actor must answer.
    fn held(&self, reader: Option<&Arc<SharedReader>>, name: &str) -> Option<ObjectView> {
        let (segments, session) = (self.session.segments(), self.session.holder_alive());
        crate::shared_reads::view(reader?, segments, name, &session)
    }

    /// Gets through the table actor (names the shared directory did not serve).
    async fn get_from_table(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        self.get_from_table_newer(names, &[], timeout).await
    }

    /// Gets through the table actor, of versions above `newer_than` (per name; see
    /// [`Session::get_newer`]).
    async fn get_from_table_newer(
        &self,
        names: &[&str],
        newer_than: &[u64],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        let results = self.session.get_newer(names, newer_than, timeout).await?;
        // Wrap every reference in a view first, so an error below still releases them all.
        let mut views = Vec::with_capacity(results.len());
        let mut failure = None;
        for r in results {
            views.push(match r {
                None => None,
                Some(r) => match self.session.mapped(&r).await {
                    // SAFETY: `m` is the session's mapping of the object the table handed out.
                    Ok(m) => Some(unsafe { ObjectView::from_mapped(r, m, self.session.sink()) }),
                    Err(e) => {
                        self.session.release_later(vec![r.id]);
                        failure = Some(e);
                        None
                    }
                },
            });
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(views),
        }
    }
}

/// Runs the [`AsyncStore`] method of the same name to completion: what the blocking API of the
/// embedded engine is, but for the gets that the shared directory answers without an executor.
macro_rules! block_on_async_store {
    ($($name:ident($($arg:ident: $ty:ty),*) -> $out:ty;)*) => {
        $(fn $name(&self, $($arg: $ty),*) -> Result<$out, Error> {
            block_on(AsyncStore::$name(self, $($arg),*))
        })*
    };
}

impl Store for EngineHandle {
    block_on_async_store! {
        create(name: &str, size: u64, metadata: &[u8], options: CreateOptions) -> ObjectBuffer;
        seal(name: &str) -> u64;
        abort(name: &str) -> ();
        put(name: &str, data: &[u8], metadata: &[u8], options: CreateOptions) -> ();
        get_newer(name: &str, newer_than: u64, timeout: Option<Duration>) -> ObjectView;
        contains(name: &str) -> bool;
        delete(name: &str) -> ();
        list() -> Vec<ObjectInfo>;
        evict(bytes: u64) -> u64;
        stats() -> StoreStats;
    }

    fn get(
        &self,
        names: &[&str],
        timeout: Option<Duration>,
    ) -> Result<Vec<Option<ObjectView>>, Error> {
        // Once the session's reader is mapped, what it serves needs no executor at all.
        let Some(reader) = self.session.shared_reader_now() else {
            return block_on(AsyncStore::get(self, names, timeout));
        };
        DirectoryPart::look(names, |n| self.held(Some(&reader), n))
            .then_ask(|rest| block_on(self.get_from_table(rest, timeout)))
    }
    fn get_one(&self, name: &str, timeout: Option<Duration>) -> Result<ObjectView, Error> {
        // Every single get: straight from the shared directory when it has the name, without
        // the lists `get` builds (a fifth of this path's time); else the table actor (the
        // directory is not asked twice).
        let found = match self.session.shared_reader_now() {
            Some(reader) => match self.held(Some(&reader), name) {
                Some(v) => return Ok(v),
                None => block_on(self.get_from_table(&[name], timeout))?,
            },
            None => block_on(AsyncStore::get(self, &[name], timeout))?,
        };
        found
            .into_iter()
            .next()
            .flatten()
            .ok_or_else(|| Error::NotFound(name.to_string()))
    }
}
