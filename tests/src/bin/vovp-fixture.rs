//! `vovp-fixture`: the test suite's client process. Commands that only tests and measurements
//! need (holding references while another process acts, hammering, CUDA copies and their
//! checksums, copy bandwidth), kept out of the user-facing `vovp` CLI. Same `-s SOCKET` option.
//! Used by tests/tests/*.rs (through `Daemon::fixture*`), python/tests/test_cuda.py
//! ($VOVP_FIXTURE_BIN) and gpu/check.sh.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use clap::{Parser, Subcommand};
use vovp::{CreateOptions, CudaStore, DType, Device, Error, ObjectView, Store, TensorMeta};
use vovp_client::Client;

#[derive(Parser)]
#[command(
    name = "vovp-fixture",
    about = "test-only client process of a vovp-engine"
)]
struct Args {
    #[arg(short = 's', long = "socket", default_value = "/tmp/vovp.sock")]
    socket: PathBuf,
    /// Do not put through a lend (`ClientOptions::no_lend_puts`).
    #[arg(long)]
    no_lend_puts: bool,
    /// Run as this uid (and gid) from the start, before connecting: the fixture must be
    /// started as root. For the `--allow-uid` tests: a client of another uid.
    #[arg(long)]
    as_uid: Option<u32>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Get NAMEs and hold the references (prints "holding", then sleeps).
    Hold {
        names: Vec<String>,
        #[arg(long, default_value_t = 3600)]
        seconds: u64,
        /// After "holding", wait (GET with a long timeout) for this name instead of sleeping.
        #[arg(long)]
        wait_for: Option<String>,
    },
    /// Create NAME unsealed, write PATTERN into it, print "created" and sleep (never sealing).
    CreateHold {
        name: String,
        size: u64,
        #[arg(long, default_value_t = 3600)]
        seconds: u64,
        /// Create a replacement of an existing NAME (its next version, were it sealed).
        #[arg(long)]
        replace: bool,
    },
    /// Put COUNT objects PREFIX0.. of SIZE bytes (object i filled with byte i, metadata "m{i}"),
    /// keeping a reference to each; print "put LAST_REQUEST_ID" and sleep.
    PutHold {
        prefix: String,
        count: u32,
        size: u64,
        #[arg(long, default_value_t = 3600)]
        seconds: u64,
    },
    /// Get NAMEs (no wait) and print `NAME len=N fnv=HASH meta=METADATA` for each (the bytes'
    /// FNV-1a, in hex; the metadata lossily as UTF-8).
    Read { names: Vec<String> },
    /// Get a version of NAME newer than VERSION, waiting up to a minute; print
    /// `NAME version=V first=B` (B: its first byte).
    ReadNewer { name: String, version: u64 },
    /// Get NAME, print "got", then write one byte into the view's memory: a client that may
    /// not write the object dies of SIGSEGV there; if the write goes through, prints "wrote".
    /// With --private, writes through a private view (`Client::private_view`) instead and
    /// prints the view's own `fnv=` afterwards (the store's bytes, if the write stayed private).
    WriteView {
        name: String,
        #[arg(long)]
        private: bool,
    },
    /// Put NAME: SIZE bytes of FILL (`put`, then `sync` for a pipelined put's answer), or with
    /// --create through create, a write of the bytes and seal. Prints `ok`, or `err ERROR`
    /// (its Debug form, e.g. `err OutOfMemory { .. }`) and exits 1.
    Put {
        name: String,
        size: u64,
        #[arg(long, default_value_t = 0x5A)]
        fill: u8,
        #[arg(long)]
        create: bool,
    },
    /// Put NAME (SIZE bytes: a lend put in a store of 64 MiB or more) from a source buffer with
    /// an unreadable page in its middle: the copy into the lend writes the first half, then
    /// faults; the fault handler prints "writing" and waits to be killed. So the process dies
    /// in the middle of writing into its lend, its PUBLISH never sent.
    LendWriteDie { name: String, size: usize },
    /// Mixed operations for SECONDS on shared names; prints the operation count.
    Hammer {
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 32)]
        names: u64,
        /// Objects are 0..MAX_SIZE bytes (past 64 KiB puts go through a lend, past 256 KiB
        /// creates and puts both write into the client's arena).
        #[arg(long, default_value_t = 100_000)]
        max_size: u64,
    },
    /// For SECONDS: replaces names `cSEED-0..NAMES` in turn (delete, then put MIN_SIZE..MAX_SIZE
    /// bytes), holding nothing, so that a full store evicts and objects keep moving between
    /// the clients' arenas. Prints the puts made.
    Churn {
        #[arg(long, default_value_t = 3)]
        seconds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 12)]
        names: u64,
        #[arg(long, default_value_t = 1 << 20)]
        min_size: u64,
        #[arg(long, default_value_t = 4 << 20)]
        max_size: u64,
    },
    /// One side of the shared-reads stress test for SECONDS on names `s0..sNAMES`. `reader`:
    /// gets (through the shared directory where it can), keeps a few views and re-checks every
    /// held view's tag and checksum on every round, so memory freed or reused under a hold
    /// shows; exits 3 at the first bad object. `writer`: deletes and re-puts names with new
    /// generations, and puts fillers that force eviction. Prints `ops=N found=M` at the end.
    SharedStress {
        role: String,
        #[arg(long, default_value_t = 5)]
        seconds: u64,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value_t = 64)]
        names: u64,
    },
    /// Create a CUDA object of N bytes on cuda:D, copy a host buffer filled with BYTE into it,
    /// seal. Prints nothing.
    PutCuda {
        name: String,
        /// Size (1000000, 64K, 512M, 1G).
        #[arg(long, value_parser = parse_size)]
        bytes: u64,
        #[arg(long)]
        fill: u8,
        #[arg(long, default_value_t = 0)]
        device: u32,
    },
    /// Copy a CUDA object to the host and print `len=N first=B last=B sum=S`.
    GetCuda {
        name: String,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
    },
    /// Get a CUDA object and hold it (prints "holding", then sleeps). With --report, instead
    /// prints the held bytes' `len= first= last= sum=` for every line read on stdin, and exits at
    /// the end of stdin.
    HoldCuda {
        name: String,
        #[arg(long, default_value_t = 3600)]
        seconds: u64,
        #[arg(long)]
        report: bool,
    },
    /// Store DST as a copy of the CUDA object SRC (same device, same size) with
    /// `put_cuda_tensor` (a uint8 tensor: create, device-to-device copy, seal); prints
    /// `bytes=N seconds=S gbps=G` for the whole put.
    PutCudaD2d {
        dst: String,
        src: String,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
    },
    /// Measure raw device-to-device copy bandwidth between two store objects of N bytes (the
    /// reference for put-cuda-d2d); prints `bytes=N runs=R seconds=S gbps=G` (S per copy).
    CudaBandwidth {
        #[arg(long, value_parser = parse_size)]
        bytes: u64,
        #[arg(long, default_value_t = 0)]
        device: u32,
        #[arg(long, default_value_t = 10)]
        runs: u32,
    },
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vovp-fixture: {e}");
            ExitCode::FAILURE
        }
    }
}

fn timeout(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

fn run(args: Args) -> Result<(), Error> {
    if let Some(uid) = args.as_uid {
        become_uid(uid)?;
    }
    let client = Client::connect_with(
        &args.socket,
        vovp_client::ClientOptions {
            no_lend_puts: args.no_lend_puts,
            ..Default::default()
        },
    )?;
    let mut out = std::io::stdout().lock();
    let io = |e: std::io::Error| Error::Internal(e.to_string());
    match args.command {
        Command::Hold {
            names,
            seconds,
            wait_for,
        } => {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            let views = client.get(&names, None)?;
            if views.iter().any(Option::is_none) {
                return Err(Error::NotFound(format!("{names:?}")));
            }
            writeln!(out, "holding").map_err(io)?;
            out.flush().map_err(io)?;
            match wait_for {
                Some(name) => drop(client.get(&[&name], Some(Duration::from_secs(seconds)))?),
                None => std::thread::sleep(Duration::from_secs(seconds)),
            }
        }
        Command::CreateHold {
            name,
            size,
            seconds,
            replace,
        } => {
            let options = CreateOptions {
                replace,
                ..CreateOptions::default()
            };
            let mut b = client.create(&name, size, b"", options)?;
            b.as_mut_slice().fill(0xAB);
            writeln!(out, "created").map_err(io)?;
            out.flush().map_err(io)?;
            std::thread::sleep(Duration::from_secs(seconds));
        }
        Command::PutHold {
            prefix,
            count,
            size,
            seconds,
        } => {
            let mut kept = Vec::new();
            for i in 0..count {
                let data = vec![i as u8; size as usize];
                let meta = format!("m{i}");
                kept.push(client.put_and_view(
                    &format!("{prefix}{i}"),
                    &data,
                    meta.as_bytes(),
                    CreateOptions::default(),
                )?);
            }
            writeln!(out, "put {}", client.last_request_id()).map_err(io)?;
            out.flush().map_err(io)?;
            std::thread::sleep(Duration::from_secs(seconds));
        }
        Command::Read { names } => {
            for name in names {
                let v = client.get_one(&name, None)?;
                writeln!(
                    out,
                    "{name} len={} fnv={:x} meta={}",
                    v.len(),
                    fnv(&v),
                    String::from_utf8_lossy(v.metadata())
                )
                .map_err(io)?;
            }
        }
        Command::ReadNewer { name, version } => {
            let v = client.get_newer(&name, version, Some(Duration::from_secs(60)))?;
            let first = v.first().copied().unwrap_or(0);
            writeln!(out, "{name} version={} first={first}", v.version()).map_err(io)?;
        }
        Command::WriteView { name, private } => {
            let v = client.get_one(&name, None)?;
            writeln!(out, "got").map_err(io)?;
            out.flush().map_err(io)?;
            if private {
                let mine = client
                    .private_view(&v)?
                    .ok_or_else(|| Error::Internal(format!("{name} is not a host object")))?;
                // SAFETY: a private copy-on-write mapping of the object's bytes, kept by `mine`.
                unsafe { std::ptr::write_bytes(mine.ptr, !v[0], v.len()) };
                writeln!(out, "fnv={:x}", fnv(&v)).map_err(io)?;
            } else {
                // SAFETY: deliberately writing through a view (a read-only mapping unless the
                // object is this client's own): what the test checks is that it faults.
                unsafe { std::ptr::write_volatile(v.as_ptr().cast_mut(), !v[0]) };
                writeln!(out, "wrote").map_err(io)?;
            }
        }
        Command::Put {
            name,
            size,
            fill,
            create,
        } => {
            let put = || -> Result<(), Error> {
                if create {
                    let mut b = client.create(&name, size, b"", CreateOptions::default())?;
                    b.as_mut_slice().fill(fill);
                    b.seal().map(drop)
                } else {
                    client.put(
                        &name,
                        &vec![fill; size as usize],
                        b"",
                        CreateOptions::default(),
                    )?;
                    client.sync()
                }
            };
            if let Err(e) = put() {
                writeln!(out, "err {e:?}").map_err(io)?;
                out.flush().map_err(io)?;
                return Err(e);
            }
            writeln!(out, "ok").map_err(io)?;
        }
        Command::LendWriteDie { name, size } => lend_write_die(&client, &name, size)?,
        Command::SharedStress {
            role,
            seconds,
            seed,
            names,
        } => {
            let (ops, found) = shared_stress(&client, &role, seconds, seed, names)?;
            writeln!(out, "ops={ops} found={found}").map_err(io)?;
        }
        Command::Hammer {
            seconds,
            seed,
            names,
            max_size,
        } => {
            let ops = hammer(&client, seconds, seed, names, max_size.max(1))?;
            writeln!(out, "{ops}").map_err(io)?;
        }
        Command::Churn {
            seconds,
            seed,
            names,
            min_size,
            max_size,
        } => {
            let puts = churn(
                &client,
                seconds,
                seed,
                names,
                min_size..max_size.max(min_size + 1),
            )?;
            writeln!(out, "{puts}").map_err(io)?;
        }
        Command::PutCuda {
            name,
            bytes,
            fill,
            device,
        } => put_cuda(&client, &name, bytes, fill, device)?,
        Command::GetCuda { name, timeout_ms } => {
            let v = client.get_one(&name, timeout(timeout_ms))?;
            let summary = summarize(&v)?;
            writeln!(out, "{summary}").map_err(io)?;
        }
        Command::HoldCuda {
            name,
            seconds,
            report,
        } => {
            let v = client.get_one(&name, None)?;
            cuda_ptr(&v)?;
            writeln!(out, "holding").map_err(io)?;
            out.flush().map_err(io)?;
            if report {
                for line in std::io::stdin().lines() {
                    line.map_err(io)?;
                    writeln!(out, "{}", summarize(&v)?).map_err(io)?;
                    out.flush().map_err(io)?;
                }
            } else {
                std::thread::sleep(Duration::from_secs(seconds));
            }
        }
        Command::PutCudaD2d {
            dst,
            src,
            timeout_ms,
        } => {
            let v = client.get_one(&src, timeout(timeout_ms))?;
            let src_ptr = cuda_ptr(&v)?;
            let Device::Cuda(device) = v.device() else {
                return Err(Error::Gpu(format!("{src:?} is not a CUDA object")));
            };
            let len = i64::try_from(v.size())
                .map_err(|_| Error::TooLarge(format!("{src:?} is {} bytes", v.size())))?;
            // Warm up this process's copy stream (and check SRC is readable) outside the timing.
            if v.size() > 0 {
                vovp_gpu::ipc::copy_d2h(&mut [0u8; 1], src_ptr)?;
            }
            let t = Instant::now();
            client.put_cuda_tensor(&dst, DType::U8, &[len], device, src_ptr)?;
            let secs = t.elapsed().as_secs_f64();
            writeln!(
                out,
                "bytes={} seconds={secs:.6} gbps={:.3}",
                v.size(),
                gbps(v.size(), secs)
            )
            .map_err(io)?;
        }
        Command::CudaBandwidth {
            bytes,
            device,
            runs,
        } => {
            let secs = cuda_bandwidth(&client, bytes, device, runs.max(1))?;
            writeln!(
                out,
                "bytes={bytes} runs={} seconds={secs:.6} gbps={:.3}",
                runs.max(1),
                gbps(bytes, secs)
            )
            .map_err(io)?;
        }
    }
    Ok(())
}

/// Drops root for `uid` (as gid too, no supplementary groups). Called before any thread
/// starts, so every thread of the process runs as `uid`.
fn become_uid(uid: u32) -> Result<(), Error> {
    // SAFETY: plain system calls with no pointers but a null, empty group list.
    let failed = unsafe {
        libc::setgroups(0, std::ptr::null()) != 0
            || libc::setgid(uid) != 0
            || libc::setuid(uid) != 0
    };
    // SAFETY: getuid/geteuid cannot fail.
    if failed || unsafe { libc::getuid() != uid || libc::geteuid() != uid } {
        return Err(Error::Config(format!(
            "cannot run as uid {uid}: {} (the fixture must start as root)",
            std::io::Error::last_os_error()
        )));
    }
    Ok(())
}

/// The fault handler of `lend-write-die`: says so on stdout and waits for the SIGKILL.
extern "C" fn stop_in_the_middle_of_the_write(_: libc::c_int) {
    const LINE: &[u8] = b"writing\n";
    // SAFETY: write(2) and pause(2) are async-signal-safe; LINE is a static buffer.
    unsafe {
        libc::write(1, LINE.as_ptr().cast(), LINE.len());
        loop {
            libc::pause();
        }
    }
}

/// See `Command::LendWriteDie`.
fn lend_write_die(client: &Client, name: &str, size: usize) -> Result<(), Error> {
    const PAGE: usize = 4096;
    let len = size.next_multiple_of(PAGE);
    if len < 4 * PAGE {
        return Err(Error::Config(format!(
            "{size} bytes: too small to stop half-way"
        )));
    }
    // SAFETY: a fresh private anonymous mapping; `guard` is a whole page inside it.
    let src = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if src == libc::MAP_FAILED {
        return Err(Error::Memory(std::io::Error::last_os_error().to_string()));
    }
    let guard = len / 2 / PAGE * PAGE;
    // SAFETY: the mapping is `len` bytes, all ours; then one page of it made unreadable.
    unsafe {
        std::ptr::write_bytes(src.cast::<u8>(), 0xC3, len);
        if libc::mprotect(src.cast::<u8>().add(guard).cast(), PAGE, libc::PROT_NONE) != 0 {
            return Err(Error::Memory(std::io::Error::last_os_error().to_string()));
        }
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction =
            stop_in_the_middle_of_the_write as extern "C" fn(libc::c_int) as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(libc::SIGSEGV, &action, std::ptr::null_mut());
    }
    // SAFETY (as far as a test fixture goes): a slice over memory whose middle page faults on
    // read; only the client's copy into the lend reads it, and it never returns from the fault.
    let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), size) };
    client.put(name, data, b"never published", CreateOptions::default())?;
    Err(Error::Internal(format!(
        "the put of {name} read past the unreadable page"
    )))
}

fn parse_size(s: &str) -> Result<u64, String> {
    vovp::parse_size(s).map_err(|e| e.to_string())
}

/// Host staging for CUDA copies, so that multi-GiB objects never need as much host memory.
const CHUNK: u64 = 64 << 20;

fn gbps(bytes: u64, secs: f64) -> f64 {
    if secs > 0.0 {
        bytes as f64 / secs / 1e9
    } else {
        0.0
    }
}

/// The device address of a CUDA object in this process, or an error naming the object.
fn cuda_ptr(v: &ObjectView) -> Result<u64, Error> {
    match (v.device(), v.cuda_ptr()) {
        (Device::Cuda(_), Some(p)) => Ok(p),
        (Device::Cuda(_), None) if v.size() == 0 => Ok(0),
        (Device::Cuda(_), None) => Err(Error::Internal(format!(
            "CUDA object {} came without a device address",
            v.name()
        ))),
        (Device::Cpu, _) => Err(Error::Gpu(format!(
            "{} is a host object, not a CUDA object (use `vovp get`)",
            v.name()
        ))),
    }
}

fn cuda_options(device: u32) -> CreateOptions {
    CreateOptions {
        device: Some(Device::Cuda(device)),
        ..Default::default()
    }
}

/// Calls `f(offset, n)` for consecutive chunks of at most [`CHUNK`] bytes covering `0..len`.
fn for_chunks(len: u64, mut f: impl FnMut(u64, usize) -> Result<(), Error>) -> Result<(), Error> {
    let mut off = 0;
    while off < len {
        let n = (len - off).min(CHUNK);
        f(off, n as usize)?;
        off += n;
    }
    Ok(())
}

fn put_cuda(client: &Client, name: &str, bytes: u64, fill: u8, device: u32) -> Result<(), Error> {
    let len = i64::try_from(bytes).map_err(|_| Error::TooLarge(format!("{bytes} bytes")))?;
    let meta = TensorMeta {
        dtype: DType::U8,
        shape: vec![len],
        device: Device::Cuda(device),
        little_endian: cfg!(target_endian = "little"),
    };
    let buf = client.create(name, bytes, &meta.encode(), cuda_options(device))?;
    if bytes > 0 {
        let dst = buf.cuda_ptr().ok_or_else(|| {
            Error::Internal("a CUDA object came back without a device address".into())
        })?;
        let host = vec![fill; bytes.min(CHUNK) as usize];
        for_chunks(bytes, |off, n| {
            Ok(vovp_gpu::ipc::copy_h2d(dst + off, &host[..n])?)
        })?;
    }
    // Dropping an unsealed buffer on an error above aborts the object.
    buf.seal().map(drop)
}

/// `len=N first=B last=B sum=S` of a CUDA object's bytes (`first=none last=none` when empty).
fn summarize(v: &ObjectView) -> Result<String, Error> {
    let ptr = cuda_ptr(v)?;
    let len = v.size();
    let mut host = vec![0u8; len.min(CHUNK) as usize];
    let (mut first, mut last, mut sum) = (None, None, 0u64);
    for_chunks(len, |off, n| {
        let chunk = &mut host[..n];
        vovp_gpu::ipc::copy_d2h(chunk, ptr + off)?;
        first = first.or(chunk.first().copied());
        last = chunk.last().copied().or(last);
        sum += chunk.iter().map(|&b| u64::from(b)).sum::<u64>();
        Ok(())
    })?;
    let show = |b: Option<u8>| b.map_or_else(|| "none".to_string(), |b| b.to_string());
    Ok(format!(
        "len={len} first={} last={} sum={sum}",
        show(first),
        show(last)
    ))
}

/// Seconds per raw `copy_d2d` of `bytes` between two fresh store objects on `device` (one
/// warm-up copy, then the mean of `runs`). The objects are never sealed: dropping them aborts
/// them.
fn cuda_bandwidth(client: &Client, bytes: u64, device: u32, runs: u32) -> Result<f64, Error> {
    if bytes == 0 {
        return Err(Error::Config("--bytes must be at least 1".into()));
    }
    let len = usize::try_from(bytes).map_err(|_| Error::TooLarge(format!("{bytes} bytes")))?;
    let tag = format!("vovp-cuda-bandwidth-{}", std::process::id());
    let src = client.create(&format!("{tag}-src"), bytes, b"", cuda_options(device))?;
    let dst = client.create(&format!("{tag}-dst"), bytes, b"", cuda_options(device))?;
    let no_ptr = || Error::Internal("a CUDA object came back without a device address".into());
    let (s, d) = (
        src.cuda_ptr().ok_or_else(no_ptr)?,
        dst.cuda_ptr().ok_or_else(no_ptr)?,
    );
    let host = vec![0x5Au8; bytes.min(CHUNK) as usize];
    for_chunks(bytes, |off, n| {
        Ok(vovp_gpu::ipc::copy_h2d(s + off, &host[..n])?)
    })?;
    vovp_gpu::ipc::copy_d2d(d, s, len)?;
    let t = Instant::now();
    for _ in 0..runs {
        vovp_gpu::ipc::copy_d2d(d, s, len)?;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(runs))
}

/// Random mixed operations on `names` shared names; unexpected errors end it with an error.
/// A stress object: `name index, generation, length` (u64 each), then bytes that depend on all
/// three, then an FNV-1a checksum of everything before it.
fn stress_object(index: u64, generation: u64, len: usize) -> Vec<u8> {
    let len = len.max(32);
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&index.to_le_bytes());
    v.extend_from_slice(&generation.to_le_bytes());
    v.extend_from_slice(&(len as u64).to_le_bytes());
    for j in 24..len - 8 {
        v.push((index.wrapping_mul(131) ^ generation.wrapping_mul(7)).wrapping_add(j as u64) as u8);
    }
    let sum = fnv(&v);
    v.extend_from_slice(&sum.to_le_bytes());
    v
}

fn fnv(bytes: &[u8]) -> u64 {
    vovp_tests::fnv(bytes)
}

/// Checks a stress object got under name index `index`: why it is bad, if it is.
fn check_stress_object(bytes: &[u8], index: u64) -> Result<(), String> {
    let word = |at: usize| {
        bytes
            .get(at..at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
    };
    let (Some(i), Some(g), Some(len)) = (word(0), word(8), word(16)) else {
        return Err(format!("only {} bytes", bytes.len()));
    };
    if i != index || len != bytes.len() as u64 {
        return Err(format!(
            "tag says name {i}, {len} bytes; got under name {index}, {} bytes",
            bytes.len()
        ));
    }
    if stress_object(i, g, bytes.len()) != bytes {
        return Err(format!("name {i} generation {g}: bytes or checksum wrong"));
    }
    Ok(())
}

fn shared_stress(
    client: &Client,
    role: &str,
    seconds: u64,
    seed: u64,
    names: u64,
) -> Result<(u64, u64), Error> {
    let mut next = xorshift(seed);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let (mut ops, mut found) = (0, 0);
    let mut held: Vec<(u64, ObjectView)> = Vec::new();
    let mut generation = seed << 40;
    while Instant::now() < deadline {
        ops += 1;
        let index = next() % names;
        let name = format!("s{index}");
        match role {
            "reader" => {
                if let Some(v) = client.get(&[&name], None)?.pop().flatten() {
                    found += 1;
                    held.push((index, v));
                }
                for (i, v) in &held {
                    if let Err(why) = check_stress_object(v, *i) {
                        eprintln!("CORRUPT s{i}: {why}");
                        std::process::exit(3);
                    }
                }
                while held.len() > (next() % 8) as usize {
                    let k = next() as usize % held.len();
                    held.swap_remove(k);
                }
            }
            _ => {
                match next() % 4 {
                    0 => match client.delete(&name) {
                        Ok(()) | Err(Error::NotFound(_) | Error::NotSealed(_)) => {}
                        Err(e) => return Err(e),
                    },
                    1 => {
                        // A filler: memory runs short and the LRU evicts.
                        let filler = format!("fill{}-{}", seed, next() % 16);
                        let _ = client.delete(&filler);
                        let size = (next() % 200_000) as usize;
                        match client.put(&filler, &vec![0xEE; size], b"", CreateOptions::default())
                        {
                            Ok(()) | Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                            Err(e) => return Err(e),
                        }
                    }
                    _ => {
                        generation += 1;
                        let len = 32 + (next() % 120_000) as usize;
                        let data = stress_object(index, generation, len);
                        match client.put(&name, &data, b"stress", CreateOptions::default()) {
                            Ok(()) => found += 1,
                            Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                            Err(e) => return Err(e),
                        }
                    }
                }
            }
        }
    }
    drop(held);
    // Queued releases reach the daemon before the count is printed.
    client.stats()?;
    Ok((ops, found))
}

fn churn(
    client: &Client,
    seconds: u64,
    seed: u64,
    names: u64,
    sizes: std::ops::Range<u64>,
) -> Result<u64, Error> {
    let mut next = xorshift(seed);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let (mut puts, mut round) = (0, 0);
    while Instant::now() < deadline {
        let name = format!("c{seed}-{}", round % names.max(1));
        round += 1;
        match client.delete(&name) {
            Ok(()) | Err(Error::NotFound(_) | Error::NotSealed(_)) => {}
            Err(e) => return Err(e),
        }
        let size = sizes.start + next() % (sizes.end - sizes.start);
        match client.put(
            &name,
            &vec![seed as u8; size as usize],
            b"",
            CreateOptions::default(),
        ) {
            Ok(()) => puts += 1,
            Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    client.stats()?;
    Ok(puts)
}

/// A small deterministic generator (xorshift64) for the fixture's random operations.
fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut rng = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    }
}

fn hammer(
    client: &Client,
    seconds: u64,
    seed: u64,
    names: u64,
    max_size: u64,
) -> Result<u64, Error> {
    let mut next = xorshift(seed);
    let deadline = Instant::now() + Duration::from_secs(seconds);
    let mut held = Vec::new();
    let mut ops = 0;
    while Instant::now() < deadline {
        let name = format!("h{}", next() % names);
        let size = next() % max_size;
        let fill = (seed % 251) as u8;
        match next() % 6 {
            0 => match client.create(&name, size, b"", CreateOptions::default()) {
                Ok(mut b) => {
                    b.as_mut_slice().fill(fill);
                    if next().is_multiple_of(3) {
                        drop(b);
                    } else {
                        held.push(b.seal()?);
                    }
                }
                Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                Err(e) => return Err(e),
            },
            1 | 2 => {
                if let Some(v) = client.get(&[&name], None)?.pop().flatten() {
                    let first = v.first().copied();
                    if !v.iter().all(|b| Some(*b) == first) {
                        return Err(Error::Internal(format!("{name}: sealed bytes changed")));
                    }
                    held.push(v);
                }
            }
            3 => match client.delete(&name) {
                Ok(()) | Err(Error::NotFound(_) | Error::NotSealed(_)) => {}
                Err(e) => return Err(e),
            },
            4 => {
                if !held.is_empty() {
                    let i = next() as usize % held.len();
                    held.swap_remove(i);
                }
            }
            _ => match client.put(
                &name,
                &vec![fill; size as usize],
                b"",
                CreateOptions::default(),
            ) {
                Ok(()) | Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                Err(e) => return Err(e),
            },
        }
        ops += 1;
    }
    drop(held);
    // Make sure queued releases reach the daemon before exiting.
    client.stats()?;
    Ok(ops)
}
