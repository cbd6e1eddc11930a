//! The directory and a hold table across a real process boundary: the store (this test)
//! creates the memfds; a child process (this test binary again, re-run on one test) maps the
//! directory through the read-only fd it inherited, reads it, takes a hold, and proves it
//! cannot write the directory.
#![cfg(not(loom))]

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, ExitStatus};

use vovp_shm::{
    held_generations, is_held, DirectoryMap, DirectoryRegion, Get, HoldMap, HoldRegion, Lookup,
    Publish,
};

const ROLE: &str = "VOVP_SHM_CHILD_ROLE";
const DIR_FD: &str = "VOVP_SHM_CHILD_DIR_FD";
const HOLD_FD: &str = "VOVP_SHM_CHILD_HOLD_FD";

/// An inheritable duplicate of `fd` (the regions' fds are close-on-exec, as they should be).
fn inheritable(fd: impl AsFd) -> OwnedFd {
    rustix::io::dup(fd).expect("dup")
}

fn run_child(role: &str, dir: &OwnedFd, hold: Option<&OwnedFd>) -> ExitStatus {
    let mut cmd = Command::new(std::env::current_exe().expect("current_exe"));
    cmd.args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(ROLE, role)
        .env(DIR_FD, dir.as_raw_fd().to_string());
    if let Some(h) = hold {
        cmd.env(HOLD_FD, h.as_raw_fd().to_string());
    }
    cmd.status().expect("spawning the child")
}

/// The child's side; a no-op in a normal test run.
#[test]
fn child() {
    let Ok(role) = std::env::var(ROLE) else {
        return;
    };
    let fd = |var: &str| -> File {
        let n: i32 = std::env::var(var).expect(var).parse().expect("fd number");
        // SAFETY: the parent passed this inherited fd for this process to own.
        unsafe { File::from_raw_fd(n) }
    };
    let dir_file = fd(DIR_FD);
    // The access mode the store handed over.
    let mode = rustix::fs::fcntl_getfl(&dir_file).expect("F_GETFL") & rustix::fs::OFlags::RWMODE;
    assert_eq!(
        mode,
        rustix::fs::OFlags::RDONLY,
        "the directory fd must be O_RDONLY"
    );
    // Neither this fd nor a read-write reopening of it can be mapped writable.
    assert!(memmap2::MmapOptions::new()
        .len(64)
        .map_raw(&dir_file)
        .is_err());
    if let Ok(rw) = rustix::fs::open(
        format!("/proc/self/fd/{}", dir_file.as_raw_fd()),
        rustix::fs::OFlags::RDWR | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    ) {
        assert!(
            memmap2::MmapOptions::new()
                .len(64)
                .map_raw(&File::from(rw))
                .is_err(),
            "the write seal must refuse a writable mapping"
        );
    }
    let dir = DirectoryMap::open(&dir_file).expect("mapping the directory");
    match role.as_str() {
        "hold" => {
            let Lookup::Found(s) = dir.reader().lookup(b"shared") else {
                panic!("the child does not see the store's entry")
            };
            assert_eq!((s.object_id, s.offset, s.size), (77, 4096, 64));
            let mut holds_map = HoldMap::open(&fd(HOLD_FD)).expect("mapping the hold table");
            let mut holds = holds_map.holds();
            let Get::Held(_never_released) = holds.get(&dir.reader(), b"shared", 1).expect("get")
            else {
                panic!("no hold")
            };
            // Dies holding it (exit runs no destructors, and a `Hold` has none): the parent
            // must see the hold, then drop the table.
            std::process::exit(0);
        }
        "write" => {
            // Writing through the read-only mapping must fault (SIGSEGV); reaching the exit
            // below fails the parent's check.
            let region = memmap2::MmapOptions::new()
                .len(64)
                .map_raw_read_only(&dir_file)
                .expect("read-only map");
            // SAFETY: none; this write is expected to kill the process before it lands.
            unsafe { std::ptr::write_volatile(region.as_mut_ptr() as *mut u64, 0) };
            std::process::exit(3);
        }
        other => panic!("unknown role {other}"),
    }
}

#[test]
fn child_reads_the_directory_and_its_hold_pins_the_object_until_dropped() {
    let mut dir = DirectoryRegion::create(64).unwrap();
    let (index, generation) = dir
        .writer()
        .publish(&Publish {
            name: b"shared",
            object_id: 77,
            segment: 0,
            offset: 4096,
            size: 64,
            meta_offset: 0,
            meta_len: 0,
            flags: 0,
            version: 1,
        })
        .unwrap();
    let table = HoldRegion::create(8, 1).unwrap();
    let (dir_fd, hold_fd) = (inheritable(dir.read_only_fd()), inheritable(table.fd()));
    let status = run_child("hold", &dir_fd, Some(&hold_fd));
    assert!(status.success(), "child failed: {status}");
    // The child exited holding the object: delete stays deferred while its table is live.
    dir.writer().unpublish(index, generation).unwrap();
    assert!(is_held([table.view()], generation));
    // Parked: the store's scan names it while the table lives.
    assert!(held_generations([table.view()]).contains(&generation));
    // The store learns of the death and drops the whole table: nothing names it any more.
    drop(table);
    assert!(held_generations([]).is_empty());
}

#[test]
fn child_writing_the_directory_faults() {
    let dir = DirectoryRegion::create(4).unwrap();
    let dir_fd = inheritable(dir.read_only_fd());
    let status = run_child("write", &dir_fd, None);
    assert_eq!(
        status.signal(),
        Some(rustix::process::Signal::SEGV.as_raw()),
        "expected SIGSEGV, got {status}"
    );
    // And the directory is untouched.
    let map = DirectoryMap::open(dir.read_only_fd()).unwrap();
    assert_eq!(map.reader().lookup(b"x"), Lookup::Missing);
}
