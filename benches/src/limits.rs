//! The machine's own limits, measured in the same run as the stores: what a small request over
//! a Unix socket and a bulk copy into shared memory cost with no store in the way. The Rust-level
//! workloads are reported against these.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::Instant;

use memmap2::{MmapMut, MmapOptions};

/// Bytes each round trip carries: about a small request frame (header + name + 64 B of data).
const ECHO_LEN: usize = 64;

/// A bare Unix-socket round trip: a thread echoes fixed-size messages over a socketpair, like a
/// daemon that does no work. Blocking reads and writes on both ends, as the clients do.
pub struct SocketEcho {
    stream: UnixStream,
    thread: Option<JoinHandle<()>>,
}

impl SocketEcho {
    pub fn start() -> io::Result<Self> {
        let (stream, mut peer) = UnixStream::pair()?;
        let thread = std::thread::Builder::new()
            .name("socket-echo".into())
            .spawn(move || {
                let mut buf = [0u8; ECHO_LEN];
                // Ends when the other side closes.
                while peer.read_exact(&mut buf).is_ok() && peer.write_all(&buf).is_ok() {}
            })?;
        Ok(SocketEcho {
            stream,
            thread: Some(thread),
        })
    }

    /// Mean microseconds per round trip over `n` round trips.
    pub fn batch_us(&mut self, n: usize) -> io::Result<f64> {
        round_trips(&mut self.stream, n)
    }
}

impl Drop for SocketEcho {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// The same echo served by a forked child process: what a daemon that does no work costs. A
/// round trip between processes pays what one between threads does not (an address-space
/// switch on each wakeup), and the client and its daemon are two processes.
pub struct ProcessEcho {
    stream: UnixStream,
    child: libc::pid_t,
}

impl ProcessEcho {
    pub fn start() -> io::Result<Self> {
        let (stream, peer) = UnixStream::pair()?;
        let fd = std::os::fd::AsRawFd::as_raw_fd(&peer);
        // SAFETY: the child only calls async-signal-safe functions (read, write, _exit) on an
        // fd it inherited, as required after fork in a multi-threaded process.
        let pid = unsafe { libc::fork() };
        if pid < 0 {
            return Err(io::Error::last_os_error());
        }
        if pid == 0 {
            unsafe {
                let mut buf = [0u8; ECHO_LEN];
                loop {
                    let mut got = 0usize;
                    while got < ECHO_LEN {
                        let n = libc::read(fd, buf.as_mut_ptr().add(got).cast(), ECHO_LEN - got);
                        if n <= 0 {
                            libc::_exit(0);
                        }
                        got += n as usize;
                    }
                    let mut sent = 0usize;
                    while sent < ECHO_LEN {
                        let n = libc::write(fd, buf.as_ptr().add(sent).cast(), ECHO_LEN - sent);
                        if n <= 0 {
                            libc::_exit(0);
                        }
                        sent += n as usize;
                    }
                }
            }
        }
        drop(peer);
        Ok(ProcessEcho { stream, child: pid })
    }

    /// Mean microseconds per round trip over `n` round trips.
    pub fn batch_us(&mut self, n: usize) -> io::Result<f64> {
        round_trips(&mut self.stream, n)
    }
}

impl Drop for ProcessEcho {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        // SAFETY: reaping our own child, which exits on EOF.
        unsafe {
            libc::waitpid(self.child, std::ptr::null_mut(), 0);
        }
    }
}

fn round_trips(stream: &mut UnixStream, n: usize) -> io::Result<f64> {
    let msg = [0x5au8; ECHO_LEN];
    let mut buf = [0u8; ECHO_LEN];
    let t = Instant::now();
    for _ in 0..n {
        stream.write_all(&msg)?;
        stream.read_exact(&mut buf)?;
    }
    Ok(t.elapsed().as_secs_f64() * 1e6 / n as f64)
}

/// Pins the calling thread to one CPU.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    // SAFETY: cpu_set_t is plain data; sched_setaffinity(0, ..) affects only this thread.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    // SAFETY: as above; sched_getaffinity only writes the set.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Mean µs per round trip of a [`SocketEcho`] whose two ends are pinned to `client_cpu` and
/// `echo_cpu`. On a VM a wakeup on another, idle vCPU costs an inter-processor interrupt and a
/// vCPU resume; pinning both ends to one CPU or to two shows what each placement costs, since
/// the scheduler decides the placement of a client and its daemon.
pub fn pinned_rtt_us(client_cpu: usize, echo_cpu: usize, n: usize) -> io::Result<f64> {
    std::thread::scope(|s| {
        s.spawn(|| {
            pin_current_thread(client_cpu)?;
            let (stream, mut peer) = UnixStream::pair()?;
            let echo = s.spawn(move || -> io::Result<()> {
                pin_current_thread(echo_cpu)?;
                let mut buf = [0u8; ECHO_LEN];
                while peer.read_exact(&mut buf).is_ok() && peer.write_all(&buf).is_ok() {}
                Ok(())
            });
            let mut e = SocketEcho {
                stream,
                thread: None,
            };
            e.batch_us(n / 10)?; // warm-up: both threads on their CPUs
            let us = e.batch_us(n);
            drop(e);
            echo.join()
                .map_err(|_| io::Error::other("echo thread panicked"))??;
            us
        })
        .join()
        .map_err(|_| io::Error::other("client thread panicked"))?
    })
}

/// A fresh memfd of `len` bytes mapped shared: the same kind of memory the store's segments are.
pub struct SharedMapping {
    _file: File,
    map: MmapMut,
}

impl SharedMapping {
    pub fn new(len: usize) -> io::Result<Self> {
        let file = memfd::MemfdOptions::new()
            .close_on_exec(true)
            .create("vovp-bench-memcpy")
            .map_err(io::Error::other)?
            .into_file();
        file.set_len(len as u64)?;
        // SAFETY: a private memfd nobody else maps or resizes.
        let map = unsafe { MmapOptions::new().len(len).map_mut(&file)? };
        Ok(SharedMapping { _file: file, map })
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        &mut self.map[..]
    }
}

/// GB/s (10^9 bytes per second) of one `vovp::parallel_copy` of `src` into `dst`.
pub fn copy_gbps(dst: &mut [u8], src: &[u8]) -> f64 {
    let t = Instant::now();
    vovp::parallel_copy(dst, src);
    let s = t.elapsed().as_secs_f64();
    std::hint::black_box(&dst[dst.len() / 2]);
    src.len() as f64 / s / 1e9
}

/// GB/s of a copy split into one contiguous part per thread, on `threads` scoped threads (the
/// caller copies the first part). A second measure of the machine's copy bandwidth, next to
/// [`copy_gbps`]: how the copy is split changes the bandwidth by tens of percent here.
pub fn split_copy_gbps(dst: &mut [u8], src: &[u8], threads: usize) -> f64 {
    assert_eq!(dst.len(), src.len());
    let part = src.len().div_ceil(threads.max(1)).max(1);
    let t = Instant::now();
    std::thread::scope(|s| {
        let mut parts = dst.chunks_mut(part).zip(src.chunks(part));
        let first = parts.next();
        for (d, x) in parts {
            s.spawn(move || d.copy_from_slice(x));
        }
        if let Some((d, x)) = first {
            d.copy_from_slice(x);
        }
    });
    let secs = t.elapsed().as_secs_f64();
    std::hint::black_box(&dst[dst.len() / 2]);
    src.len() as f64 / secs / 1e9
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn echo_round_trips() {
        let mut e = SocketEcho::start().unwrap();
        let us = e.batch_us(100).unwrap();
        assert!(us > 0.0 && us < 1e5, "{us}");
    }

    #[test]
    fn process_echo_round_trips() {
        let mut e = ProcessEcho::start().unwrap();
        let us = e.batch_us(100).unwrap();
        assert!(us > 0.0 && us < 1e5, "{us}");
    }

    #[test]
    fn pinned_round_trips() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty());
        let us = pinned_rtt_us(cpus[0], cpus[cpus.len() - 1], 100).unwrap();
        assert!(us > 0.0 && us < 1e5, "{us}");
    }

    #[test]
    fn copies_into_a_shared_mapping() {
        let src = crate::pattern(3 << 20, 2);
        let mut m = SharedMapping::new(src.len()).unwrap();
        assert!(copy_gbps(m.as_mut_slice(), &src) > 0.0);
        assert_eq!(m.as_mut_slice(), &src[..]);
        let mut m = SharedMapping::new(src.len()).unwrap();
        assert!(split_copy_gbps(m.as_mut_slice(), &src, 3) > 0.0);
        assert_eq!(m.as_mut_slice(), &src[..]);
    }
}
