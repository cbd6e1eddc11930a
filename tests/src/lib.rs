//! Helpers for the cross-process tests: start the real `vovp-engine` on a private socket, run
//! the `vovp` CLI (user commands) or the `vovp-fixture` binary (test-only commands:
//! src/bin/vovp-fixture.rs) as another client process, wait for conditions.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

pub mod memfd;

/// The workspace's binaries, built on first use when missing (so `cargo test --workspace` works
/// on a fresh clone with nothing built). Set `VOVP_BIN_DIR` to use others.
pub fn bin(name: &str) -> PathBuf {
    if let Some(dir) = std::env::var_os("VOVP_BIN_DIR") {
        let path = PathBuf::from(dir).join(name);
        assert!(
            path.exists(),
            "{} is missing (VOVP_BIN_DIR)",
            path.display()
        );
        return path;
    }
    // target/<profile>/deps/<test binary> -> target/<profile>
    let exe = std::env::current_exe().expect("current exe");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .to_path_buf();
    let path = dir.join(name);
    // Always (once per test process; a no-op when fresh): a stale binary would test old code.
    build_binaries(&dir);
    assert!(
        path.exists(),
        "{} is missing after building it",
        path.display()
    );
    path
}

/// Builds the daemon, the CLI and the fixture into the profile directory the tests run from,
/// once per test process (cargo's own lock serialises concurrent test binaries doing the same).
fn build_binaries(profile_dir: &Path) {
    static BUILT: std::sync::Once = std::sync::Once::new();
    BUILT.call_once(|| {
        let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.args([
            "build",
            "-p",
            "vovp-transport",
            "-p",
            "vovp-tests",
            "--bins",
        ]);
        if profile_dir.file_name().is_some_and(|n| n == "release") {
            cmd.arg("--release");
        }
        if let Some(target) = profile_dir.parent() {
            cmd.env("CARGO_TARGET_DIR", target);
        }
        let status = cmd.status().expect("run cargo build for the test binaries");
        assert!(
            status.success(),
            "building vovp-engine, vovp and vovp-fixture failed"
        );
    });
}

/// A daemon on a private socket, killed on drop.
pub struct Daemon {
    pub child: Child,
    pub socket: PathBuf,
    dir: PathBuf,
}

impl Daemon {
    pub fn start(memory: &str) -> Daemon {
        Self::start_with(memory, &[])
    }

    pub fn start_with(memory: &str, extra: &[&str]) -> Daemon {
        let dir = private_dir();
        let socket = dir.join("vovp.sock");
        Self::spawn(memory, socket, dir, extra, false)
    }

    /// A daemon that checks its page accounting against the kernel after every allocator
    /// message (`VOVP_AUDIT_PAGES=1`), its log in a file: [`Daemon::log`].
    pub fn start_audited(memory: &str, extra: &[&str]) -> Daemon {
        let dir = private_dir();
        let socket = dir.join("vovp.sock");
        Self::spawn(memory, socket, dir, extra, true)
    }

    /// What an audited daemon logged so far (warnings and errors).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.join("engine.log")).unwrap_or_default()
    }

    /// A daemon on an existing socket path (e.g. a stale one left by a killed daemon).
    pub fn start_with_socket(memory: &str, socket: &Path) -> Daemon {
        let dir = private_dir();
        Self::spawn(memory, socket.to_path_buf(), dir, &[], false)
    }

    fn spawn(memory: &str, socket: PathBuf, dir: PathBuf, extra: &[&str], audited: bool) -> Daemon {
        let mut cmd = Command::new(bin("vovp-engine"));
        if audited {
            let log = std::fs::File::create(dir.join("engine.log")).expect("daemon log");
            cmd.env("VOVP_AUDIT_PAGES", "1").stderr(log);
        }
        let child = cmd
            .arg("-m")
            .arg(memory)
            .arg("-s")
            .arg(&socket)
            .args(extra)
            .arg("--log-level")
            .arg("warn")
            .stdout(Stdio::null())
            .spawn()
            .expect("spawn vovp-engine");
        let d = Daemon { child, socket, dir };
        wait_until(Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&d.socket).is_ok()
        });
        d
    }

    pub fn client(&self) -> vovp_client::Client {
        vovp_client::Client::connect(&self.socket).expect("connect")
    }

    /// A client of this daemon with `options`.
    pub fn client_with(&self, options: vovp_client::ClientOptions) -> vovp_client::Client {
        vovp_client::Client::connect_with(&self.socket, options).expect("connect")
    }

    /// Runs the `vovp` CLI against this daemon to completion.
    pub fn cli(&self, args: &[&str]) -> Output {
        self.run("vovp", args)
    }

    /// Starts the `vovp` CLI against this daemon and leaves it running.
    pub fn cli_spawn(&self, args: &[&str]) -> Child {
        self.spawn_client("vovp", args)
    }

    /// Runs the test fixture (`vovp-fixture`: hold, create-hold, hammer, the CUDA commands)
    /// against this daemon to completion.
    pub fn fixture(&self, args: &[&str]) -> Output {
        self.run("vovp-fixture", args)
    }

    /// Starts the test fixture against this daemon and leaves it running.
    pub fn fixture_spawn(&self, args: &[&str]) -> Child {
        self.spawn_client("vovp-fixture", args)
    }

    /// Starts the test fixture with piped stdin and stdout, for a conversation line by line.
    pub fn fixture_interactive(&self, args: &[&str]) -> Interactive {
        let mut child = self
            .command("vovp-fixture", args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn vovp-fixture");
        let stdout = child.stdout.take().expect("piped stdout");
        Interactive {
            stdin: child.stdin.take(),
            stdout: std::io::BufReader::new(stdout),
            child,
        }
    }

    /// `program -s SOCKET ARGS...` for one of the workspace's client binaries.
    fn command(&self, program: &str, args: &[&str]) -> Command {
        let mut cmd = Command::new(bin(program));
        cmd.arg("-s").arg(&self.socket).args(args);
        cmd
    }

    fn run(&self, program: &str, args: &[&str]) -> Output {
        self.command(program, args)
            .output()
            .unwrap_or_else(|e| panic!("run {program}: {e}"))
    }

    fn spawn_client(&self, program: &str, args: &[&str]) -> Child {
        self.command(program, args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {program}: {e}"))
    }

    /// Sends SIGTERM and waits for a clean exit.
    pub fn terminate(mut self) -> std::process::ExitStatus {
        // SAFETY: plain kill(2) on our child's pid.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        self.child.wait().expect("wait")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A fresh directory for one daemon's socket and log (removed with the daemon).
fn private_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("vovp-test-{}-{}", std::process::id(), unique()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn unique() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

/// Raw protocol access for the malformed-input and hostile-client tests: frames built by hand,
/// replies read as (opcode, request id, status).
pub struct Raw(pub std::os::unix::net::UnixStream);

impl Raw {
    pub fn connect(d: &Daemon) -> Raw {
        let s = std::os::unix::net::UnixStream::connect(&d.socket).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(20)))
            .expect("timeout");
        Raw(s)
    }
    pub fn frame(version: u8, opcode: u8, id: u64, payload: &[u8]) -> Vec<u8> {
        Self::frame_with_flags(version, opcode, 0, id, payload)
    }
    pub fn frame_with_flags(
        version: u8,
        opcode: u8,
        flags: u16,
        id: u64,
        payload: &[u8],
    ) -> Vec<u8> {
        let mut f = ((12 + payload.len()) as u32).to_le_bytes().to_vec();
        f.extend([version, opcode]);
        f.extend(flags.to_le_bytes());
        f.extend(id.to_le_bytes());
        f.extend(payload);
        f
    }
    pub fn send(&mut self, bytes: &[u8]) {
        use std::io::Write;
        self.0.write_all(bytes).expect("send");
    }
    /// Reads one reply: (opcode, request id, status).
    pub fn reply(&mut self) -> Option<(u8, u64, u8)> {
        self.reply_payload().map(|(op, id, p)| (op, id, p[0]))
    }
    /// Reads one reply whole: (opcode, request id, payload).
    pub fn reply_payload(&mut self) -> Option<(u8, u64, Vec<u8>)> {
        use std::io::Read;
        let mut h = [0u8; 16];
        self.0.read_exact(&mut h).ok()?;
        let len = u32::from_le_bytes(h[..4].try_into().ok()?) as usize - 12;
        let mut p = vec![0u8; len];
        self.0.read_exact(&mut p).ok()?;
        Some((h[5], u64::from_le_bytes(h[8..16].try_into().ok()?), p))
    }
    pub fn hello(&mut self) {
        self.send(&Self::frame(
            vovp_proto::VERSION,
            0x01,
            1,
            &7u32.to_le_bytes(),
        ));
        assert_eq!(self.reply(), Some((0x81, 1, 0)));
    }
    /// SHARED: the store makes this connection a hold table. With `take_part`, this writes
    /// into the table what a client writes when it counts its puts into its lend there
    /// (vovp-shm's `lend` handshake), which a LEND needs. Returns the hold table's fd.
    pub fn shared(&mut self, id: u64, take_part: bool) -> std::os::fd::OwnedFd {
        use std::io::Read;
        self.send(&Self::frame(vovp_proto::VERSION, 0x10, id, &[]));
        let mut h = [0u8; 16];
        let mut fds = Vec::new();
        let mut got = 0;
        while got < h.len() {
            let n = vovp_shm::fdpass::recv_with_fds(&self.0, &mut h[got..], &mut fds)
                .expect("SHARED reply");
            assert!(n > 0, "closed during SHARED");
            got += n;
        }
        let len = u32::from_le_bytes(h[..4].try_into().unwrap()) as usize - 12;
        let mut p = vec![0u8; len];
        self.0.read_exact(&mut p).expect("SHARED payload");
        assert_eq!((h[5], p[0]), (0x90, 0), "SHARED answered");
        assert_eq!(fds.len(), 2, "directory and hold table");
        if take_part {
            let word = u64::from_le_bytes(*b"VOVPLEND").to_le_bytes();
            rustix::io::pwrite(&fds[1], &word, 56).expect("write the hold table header");
        }
        fds.pop().expect("the hold table")
    }
    /// True when the daemon has closed the connection (end of file or an error on read).
    pub fn closed(&mut self) -> bool {
        use std::io::Read;
        let mut b = [0u8; 1];
        matches!(self.0.read(&mut b), Ok(0) | Err(_))
    }
}

/// A `str` field: u16 length, then the bytes.
pub fn name_payload(name: &[u8]) -> Vec<u8> {
    let mut p = (name.len() as u16).to_le_bytes().to_vec();
    p.extend(name);
    p
}

/// Resident memory of a process, in bytes (from /proc).
pub fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

/// FNV-1a (64-bit) of `bytes`: the checksum `vovp-fixture` prints (`read`, `write-view`).
pub fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Polls `f` until it holds; panics after `limit`.
pub fn wait_until(limit: Duration, mut f: impl FnMut() -> bool) {
    let start = Instant::now();
    while !f() {
        assert!(
            start.elapsed() < limit,
            "condition not reached within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A test that cannot run here (it needs root, a cgroup, setpriv...): a skip that says why, or
/// a failure where the machine is supposed to have it (`VOVP_REQUIRE_ROOT=1`, set by CI), so
/// that a missing precondition never turns into a silent pass there.
pub fn precondition_missing(why: &str) {
    if std::env::var("VOVP_REQUIRE_ROOT").is_ok_and(|v| v == "1") {
        panic!("VOVP_REQUIRE_ROOT=1 but this test cannot run: {why}");
    }
    eprintln!("skipped: {why}");
}

/// Reads one line of a child's stdout (e.g. "holding").
pub fn read_line(child: &mut Child) -> String {
    use std::io::BufRead;
    let stdout = child.stdout.as_mut().expect("piped stdout");
    let mut line = String::new();
    std::io::BufReader::new(stdout)
        .read_line(&mut line)
        .expect("read line");
    line.trim().to_string()
}

/// A CLI process spoken to line by line (see [`Daemon::fixture_interactive`]); killed on drop.
pub struct Interactive {
    pub child: Child,
    stdin: Option<std::process::ChildStdin>,
    stdout: std::io::BufReader<std::process::ChildStdout>,
}

impl Interactive {
    /// The next line of its stdout, trimmed ("" at the end of its output).
    pub fn line(&mut self) -> String {
        use std::io::BufRead;
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("read line");
        line.trim().to_string()
    }

    /// Writes `line` to its stdin and returns the line it answers.
    pub fn ask(&mut self, line: &str) -> String {
        use std::io::Write;
        let stdin = self.stdin.as_mut().expect("stdin still open");
        writeln!(stdin, "{line}").expect("write to the CLI");
        stdin.flush().expect("flush");
        self.line()
    }

    /// Closes its stdin and waits for it to exit; returns its stderr too.
    pub fn finish(mut self) -> (std::process::ExitStatus, String) {
        use std::io::Read;
        drop(self.stdin.take());
        let status = self.child.wait().expect("wait");
        let mut err = String::new();
        if let Some(mut e) = self.child.stderr.take() {
            let _ = e.read_to_string(&mut err);
        }
        (status, err)
    }
}

impl Drop for Interactive {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub type Runtime = tokio::runtime::Runtime;

/// A small tokio runtime for the async client tests.
pub fn runtime() -> Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("tokio runtime")
}

/// `VOVP_GPU_TESTS=1`: run the GPU tests (on a machine with an NVIDIA GPU, or with the fake driver
/// of `scripts/gpu-fake-test.sh`). Otherwise prints a skip note for `test` and returns false.
pub fn gpu_tests_enabled(test: &str) -> bool {
    let on = std::env::var("VOVP_GPU_TESTS").is_ok_and(|v| v == "1");
    if !on {
        println!("{test}: skipped (set VOVP_GPU_TESTS=1 on a machine with an NVIDIA GPU; see gpu/README.md)");
    }
    on
}

/// Raw CUDA driver calls for the test process, playing a framework (PyTorch, CuPy) that writes
/// and reads store memory through the device pointers the client hands out.
///
/// Why raw calls rather than `vovp_gpu::ipc`: that is what a foreign framework does with the
/// pointer, which is the point of the test, and it keeps this crate's dependencies to the public
/// API. The library is the same `libcuda.so` the client has loaded (the dynamic loader returns the
/// loaded instance), so pointers from the client are valid here; every call runs in device 0's
/// primary context (the one the client uses) and is synchronous.
pub mod cuda {
    use std::ffi::{c_char, c_int, c_void, CString};
    use std::sync::OnceLock;

    type Ctx = *mut c_void;

    struct Driver {
        init: unsafe extern "C" fn(u32) -> c_int,
        device_get: unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
        device_get_name: unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int,
        primary_ctx_retain: unsafe extern "C" fn(*mut Ctx, c_int) -> c_int,
        ctx_set_current: unsafe extern "C" fn(Ctx) -> c_int,
        ctx_synchronize: unsafe extern "C" fn() -> c_int,
        memcpy_htod: unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
        memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
        /// Device 0's primary context (a `CUcontext`, as an address so the struct is `Sync`).
        ctx: usize,
    }

    static DRIVER: OnceLock<Result<Driver, String>> = OnceLock::new();

    fn load() -> Result<Driver, String> {
        let mut handle = std::ptr::null_mut();
        for name in ["libcuda.so", "libcuda.so.1"] {
            let c = CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: dlopen of a NUL-terminated name; the handle is never closed.
            handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if !handle.is_null() {
                break;
            }
        }
        if handle.is_null() {
            return Err("libcuda.so not found".into());
        }
        let sym = |name: &str| -> Result<*mut c_void, String> {
            let c = CString::new(name).map_err(|e| e.to_string())?;
            // SAFETY: dlsym on a live handle.
            let p = unsafe { libc::dlsym(handle, c.as_ptr()) };
            if p.is_null() {
                Err(format!("libcuda.so has no {name}"))
            } else {
                Ok(p)
            }
        };
        // SAFETY (all transmutes): the driver API's documented C signatures.
        unsafe {
            let d = Driver {
                init: std::mem::transmute::<*mut c_void, unsafe extern "C" fn(u32) -> c_int>(sym(
                    "cuInit",
                )?),
                device_get: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_int, c_int) -> c_int,
                >(sym("cuDeviceGet")?),
                device_get_name: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int,
                >(sym("cuDeviceGetName")?),
                primary_ctx_retain: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut Ctx, c_int) -> c_int,
                >(sym("cuDevicePrimaryCtxRetain")?),
                ctx_set_current: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(Ctx) -> c_int,
                >(sym("cuCtxSetCurrent")?),
                ctx_synchronize: std::mem::transmute::<*mut c_void, unsafe extern "C" fn() -> c_int>(
                    sym("cuCtxSynchronize")?,
                ),
                memcpy_htod: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(u64, *const c_void, usize) -> c_int,
                >(sym("cuMemcpyHtoD_v2")?),
                memcpy_dtoh: std::mem::transmute::<
                    *mut c_void,
                    unsafe extern "C" fn(*mut c_void, u64, usize) -> c_int,
                >(sym("cuMemcpyDtoH_v2")?),
                ctx: 0,
            };
            check("cuInit", (d.init)(0))?;
            let mut dev: c_int = 0;
            let mut ctx: Ctx = std::ptr::null_mut();
            check("cuDeviceGet", (d.device_get)(&mut dev, 0))?;
            // Retained for the life of the process, like the client's own retain.
            check(
                "cuDevicePrimaryCtxRetain",
                (d.primary_ctx_retain)(&mut ctx, dev),
            )?;
            Ok(Driver {
                ctx: ctx as usize,
                ..d
            })
        }
    }

    fn check(what: &str, rc: c_int) -> Result<(), String> {
        if rc == 0 {
            Ok(())
        } else {
            Err(format!("{what} failed with CUresult {rc}"))
        }
    }

    /// The driver with device 0's primary context current on the calling thread.
    fn driver() -> Result<&'static Driver, String> {
        let d = DRIVER.get_or_init(load).as_ref().map_err(Clone::clone)?;
        // SAFETY: a retained primary context (never released).
        check("cuCtxSetCurrent", unsafe {
            (d.ctx_set_current)(d.ctx as Ctx)
        })?;
        Ok(d)
    }

    /// The name of device 0 ("NVIDIA H200", or "Fake GPU 0" under the fake driver).
    pub fn device_name() -> Result<String, String> {
        let d = driver()?;
        let mut buf = [0u8; 256];
        // SAFETY: the driver writes at most buf.len() bytes.
        check("cuDeviceGetName", unsafe {
            (d.device_get_name)(buf.as_mut_ptr().cast(), buf.len() as c_int, 0)
        })?;
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
    }

    /// True under the fake driver of `gpu/fake-cuda/` (host memory posing as device memory).
    pub fn is_fake() -> bool {
        device_name().is_ok_and(|n| n.starts_with("Fake GPU"))
    }

    /// Writes `src` to device address `dst` and waits until the bytes are in device memory.
    pub fn h2d(dst: u64, src: &[u8]) -> Result<(), String> {
        let d = driver()?;
        // SAFETY: the caller vouches that dst..dst+len is live device memory; the driver checks
        // the pointer and the context.
        unsafe {
            check(
                "cuMemcpyHtoD",
                (d.memcpy_htod)(dst, src.as_ptr().cast(), src.len()),
            )?;
            check("cuCtxSynchronize", (d.ctx_synchronize)())
        }
    }

    /// Reads device address `src` into `dst`.
    pub fn d2h(dst: &mut [u8], src: u64) -> Result<(), String> {
        let d = driver()?;
        // SAFETY: as for h2d; dst is exclusively borrowed for the synchronous copy.
        unsafe {
            check(
                "cuMemcpyDtoH",
                (d.memcpy_dtoh)(dst.as_mut_ptr().cast(), src, dst.len()),
            )?;
            check("cuCtxSynchronize", (d.ctx_synchronize)())
        }
    }
}

/// A kept put that returns before the store's answer (`Client::put_view_later`, metadata
/// `meta`); `None`: not that way.
pub fn put_later(
    c: &vovp_client::Client,
    name: &str,
    data: &[u8],
) -> Option<vovp_client::PipelinedView> {
    c.put_view_later(name, data, b"meta", Default::default())
        .expect("put_view_later")
}

/// The bytes a pipelined put's view shows.
pub fn view_bytes(v: &vovp_client::PipelinedView) -> &[u8] {
    // SAFETY: the view's bytes, kept mapped while it lives.
    unsafe { std::slice::from_raw_parts(v.as_ptr(), v.size() as usize) }
}

/// `name` taken by an object another client of `d` created and holds unsealed: the shared
/// directory does not show it, so a put of it goes out and the store refuses it. The name
/// stays taken while the returned client and buffer live.
pub fn taken_unsealed(d: &Daemon, name: &str) -> (vovp_client::Client, vovp::ObjectBuffer) {
    let creator = d.client();
    let unsealed =
        vovp::Store::create(&creator, name, 16, b"", Default::default()).expect("create");
    (creator, unsealed)
}

/// A kept put (`put_later`) of `name`, which another client holds unsealed (the shared
/// directory does not show it, so the put goes out and the store refuses it): checks that
/// `wait` reports the refusal, that there is no object view, and that `sync` reports it once.
/// Returns the failed put's view.
pub fn refused_put_later(
    c: &vovp_client::Client,
    name: &str,
    data: &[u8],
) -> vovp_client::PipelinedView {
    let failed = put_later(c, name, data).expect("sent: the directory does not show it");
    match failed.wait() {
        Err(vovp::Error::AlreadyExists(why)) => assert!(why.contains(name), "{why}"),
        other => panic!("expected the put's failure, got {other:?}"),
    }
    assert!(failed.take_view().is_none());
    assert!(matches!(c.sync(), Err(vovp::Error::AlreadyExists(_))));
    c.sync().expect("a failure is reported once");
    failed
}

/// `len` bytes that differ with `seed` (period 251, so no page repeats its neighbour's bytes).
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8)
        .collect()
}
