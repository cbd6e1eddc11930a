//! `--huge-pages` (and Plasma's `-d` on a hugetlbfs mount) across real processes: the store's
//! memory really is 2 MiB pages from the machine's reserved pool (HugePages_* in
//! /proc/meminfo move as the store reserves and backs them, and every process maps them as
//! 2 MiB pages), and a pool with no page left makes a put an `OutOfMemory` reply, never a
//! SIGBUS, with the daemon serving on.
//!
//! Needs root (the tests size the pool through /proc/sys/vm/nr_hugepages, and put it back as
//! it was). The pool is the machine's: the tests of this file take turns.

use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use vovp::{CreateOptions, Error, Store};
use vovp_tests::{precondition_missing, wait_until, Daemon};

const T: Duration = Duration::from_secs(20);
const NR_HUGEPAGES: &str = "/proc/sys/vm/nr_hugepages";

/// One test at a time uses the pool (cargo runs the tests of a file in parallel).
fn serial() -> MutexGuard<'static, ()> {
    static POOL: Mutex<()> = Mutex::new(());
    POOL.lock().unwrap_or_else(|e| e.into_inner())
}

/// The 2 MiB huge pages of /proc/meminfo.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct HugePages {
    total: u64,
    free: u64,
    /// Reserved: promised to a mapping, not yet allocated (still counted in `free`).
    rsvd: u64,
}

impl HugePages {
    fn now() -> HugePages {
        let info = std::fs::read_to_string("/proc/meminfo").expect("/proc/meminfo");
        let field = |name: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(name))
                .and_then(|v| v.trim().parse::<u64>().ok())
                .unwrap_or_else(|| panic!("no {name} in /proc/meminfo"))
        };
        HugePages {
            total: field("HugePages_Total:"),
            free: field("HugePages_Free:"),
            rsvd: field("HugePages_Rsvd:"),
        }
    }

    /// Free pages nobody has reserved: what a new reservation or allocation can take.
    fn spare(&self) -> u64 {
        self.free - self.rsvd
    }
}

/// The machine's huge-page pool, sized by the test; `vm.nr_hugepages` is put back as it was on
/// drop (pages still in use then become surplus pages, freed when released).
struct Pool {
    original: String,
}

impl Pool {
    /// The pool with exactly `spare` pages free and unreserved; `None` (after saying why) where
    /// this machine does not let us size it.
    fn with_spare(spare: u64) -> Option<Pool> {
        let original = match std::fs::read_to_string(NR_HUGEPAGES) {
            Ok(v) if std::fs::write(NR_HUGEPAGES, v.trim()).is_ok() => v.trim().to_string(),
            _ => {
                precondition_missing("huge pages: needs root to size vm.nr_hugepages");
                return None;
            }
        };
        if std::fs::metadata("/sys/kernel/mm/hugepages/hugepages-2048kB").is_err() {
            precondition_missing("huge pages: the kernel has no 2 MiB huge pages");
            return None;
        }
        let pool = Pool { original };
        if !pool.set_spare(spare) {
            precondition_missing(&format!(
                "huge pages: the kernel could not put {spare} 2 MiB pages in the pool \
                 (memory too fragmented?): {:?}",
                HugePages::now()
            ));
            return None;
        }
        Some(pool)
    }

    /// Grows or shrinks the pool until `spare` pages are free and unreserved (shrinking only
    /// ever gives back free, unreserved pages); whether it got there.
    fn set_spare(&self, spare: u64) -> bool {
        let m = HugePages::now();
        let target = m.total - m.spare() + spare;
        std::fs::write(NR_HUGEPAGES, target.to_string()).is_ok()
            && HugePages::now().spare() == spare
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        let _ = std::fs::write(NR_HUGEPAGES, &self.original);
    }
}

/// A hugetlbfs mount of our own (for `-d`), unmounted on drop.
struct Hugetlbfs {
    dir: PathBuf,
}

impl Hugetlbfs {
    fn mount() -> Option<Hugetlbfs> {
        let dir = std::env::temp_dir().join(format!("vovp-test-hugetlbfs-{}", std::process::id()));
        std::fs::create_dir_all(&dir).ok()?;
        let path = std::ffi::CString::new(dir.as_os_str().as_encoded_bytes()).ok()?;
        // SAFETY: NUL-terminated strings that outlive the call; no mount data.
        let rc = unsafe {
            libc::mount(
                c"none".as_ptr(),
                path.as_ptr(),
                c"hugetlbfs".as_ptr(),
                0,
                std::ptr::null(),
            )
        };
        if rc != 0 {
            let why = std::io::Error::last_os_error();
            let _ = std::fs::remove_dir(&dir);
            precondition_missing(&format!("huge pages: cannot mount a hugetlbfs: {why}"));
            return None;
        }
        Some(Hugetlbfs { dir })
    }
}

impl Drop for Hugetlbfs {
    fn drop(&mut self) {
        if let Ok(path) = std::ffi::CString::new(self.dir.as_os_str().as_encoded_bytes()) {
            // SAFETY: a NUL-terminated path that outlives the call.
            unsafe { libc::umount2(path.as_ptr(), libc::MNT_DETACH) };
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}

/// The page size (KiB) with which process `pid` maps the memfd `name` (e.g. `vovp-segment-0`),
/// from its /proc/PID/smaps; `None` when it does not map it.
fn page_kib(pid: u32, name: &str) -> Option<u64> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps")).ok()?;
    let wanted = format!("/memfd:{name} ");
    let mut inside = false;
    for line in smaps.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if first.contains('-') && first.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
            inside = line.contains(&wanted);
        } else if inside {
            if let Some(v) = line.strip_prefix("KernelPageSize:") {
                return v.trim().trim_end_matches("kB").trim().parse().ok();
            }
        }
    }
    None
}

/// `vovp-fixture ARGS` (a `put`) in another process, which must answer `ok`.
fn put_ok(d: &Daemon, args: &[&str]) {
    let out = d.fixture(args);
    assert!(
        out.status.success() && out.stdout == b"ok\n",
        "{args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn huge_pages_back_the_store_its_arenas_and_every_clients_mapping() {
    let _serial = serial();
    // Segment 0 (8 pages for 16 MiB), a writer's arena (8 more), and room to spare.
    let Some(_pool) = Pool::with_spare(24) else {
        return;
    };
    let mount = Hugetlbfs::mount();
    let mut ways = vec![vec!["--huge-pages".to_string()]];
    if let Some(m) = &mount {
        // Plasma's spelling: `-d` on a hugetlbfs mount means huge pages.
        ways.push(vec!["-d".to_string(), m.dir.display().to_string()]);
    }
    for flags in ways {
        let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
        let before = HugePages::now();
        let d = Daemon::start_with("16M", &flags);
        let daemon = d.child.id();
        // Segment 0 (16 MiB) reserves its 8 pages when it is made, and allocates none yet.
        let m = HugePages::now();
        assert_eq!(
            (m.free, m.rsvd),
            (before.free, before.rsvd + 8),
            "{flags:?}"
        );
        assert_eq!(page_kib(daemon, "vovp-segment-0"), Some(2048), "{flags:?}");

        // A put from another process (inline: the store copies it into segment 0). The store
        // backs the object's page at create: one huge page out of the pool.
        put_ok(&d, &["put", "small", "100000"]);
        let m = HugePages::now();
        assert_eq!(
            (m.free, m.rsvd),
            (before.free - 1, before.rsvd + 7),
            "{flags:?}"
        );
        // This process reads it through a mapping of the same 2 MiB pages.
        let c = d.client();
        let small = c.get_one("small", None).unwrap();
        assert!(small.len() == 100_000 && small.iter().all(|&b| b == 0x5A));
        assert_eq!(page_kib(std::process::id(), "vovp-segment-0"), Some(2048));

        // Too big to go inline, in a store too small to lend: a CREATE, in the writer's own
        // arena (16 MiB: its own 8 reserved pages), of which 3 MB take 2 pages.
        put_ok(&d, &["put", "big", "3000000"]);
        let m = HugePages::now();
        assert_eq!(
            (m.free, m.rsvd),
            (before.free - 3, before.rsvd + 13),
            "{flags:?}"
        );
        assert_eq!(page_kib(daemon, "vovp-segment-1"), Some(2048), "{flags:?}");
        let big = c.get_one("big", None).unwrap();
        assert!(big.len() == 3_000_000 && big.iter().all(|&b| b == 0x5A));
        assert_eq!(page_kib(std::process::id(), "vovp-segment-1"), Some(2048));

        // The pages were the store's: they all go back with it.
        drop((small, big, c));
        drop(d);
        wait_until(T, || {
            let m = HugePages::now();
            (m.free, m.rsvd) == (before.free, before.rsvd)
        });
    }
}

#[test]
fn with_no_huge_page_left_a_put_is_out_of_memory_and_the_daemon_serves_on() {
    let _serial = serial();
    // Exactly segment 0's 8 pages to spare: the store reserves them all at start (so writers'
    // arenas fall back to normal pages, as documented).
    let Some(pool) = Pool::with_spare(8) else {
        return;
    };
    let before = HugePages::now();
    let d = Daemon::start_with("16M", &["--huge-pages"]);
    let daemon = d.child.id();
    assert_eq!(
        HugePages::now().spare(),
        0,
        "segment 0 reserved the 8 pages"
    );
    let c = d.client_with(vovp_client::ClientOptions {
        no_pipelined_puts: true,
        ..Default::default()
    });

    // Inline puts (into segment 0) evicting each other: every page of segment 0 is backed.
    // Deleted, their pages stay with the store (warm for the next puts).
    for i in 0..90u32 {
        c.put(
            &format!("o{i}"),
            &[i as u8; 200_000],
            b"",
            CreateOptions::default(),
        )
        .unwrap();
    }
    assert_eq!(
        HugePages::now().free,
        before.free - 8,
        "segment 0 all backed"
    );
    for info in c.list().unwrap() {
        c.delete(info.name.as_str()).unwrap();
    }
    assert_eq!(
        HugePages::now().free,
        before.free - 8,
        "freed pages stay warm"
    );
    // A create past the budget of resident pages makes the store give its freed pages back:
    // the 8 huge pages return to the pool, segment 0's reservation of them with them. (The
    // create goes into the writer's arena, of normal pages: no huge page was spare for it.)
    put_ok(&d, &["put", "--create", "big", "4194304"]);
    let m = HugePages::now();
    assert_eq!((m.free, m.rsvd), (before.free, before.rsvd), "given back");
    assert_eq!(
        page_kib(daemon, "vovp-segment-1"),
        Some(4),
        "the arena fell back"
    );

    // Someone else takes them: the pool has no page left.
    assert!(pool.set_spare(0), "{:?}", HugePages::now());
    // A put into segment 0 needs a page the store no longer has: OUT_OF_MEMORY, to a client
    // connected before and to one connecting now (whose mapping needs no page either), and
    // no SIGBUS in either.
    match c.put_and_view("small", &[1u8; 100_000], b"", CreateOptions::default()) {
        Err(Error::OutOfMemory { requested, .. }) => assert_eq!(requested, 100_000),
        other => panic!("expected OutOfMemory, got {other:?}"),
    }
    let out = d.fixture(&["put", "small", "100000"]);
    let said = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{said} {out:?}");
    assert!(
        said.starts_with("err OutOfMemory { requested: 100000,"),
        "{said}"
    );
    assert!(!c.contains("small").unwrap());
    let s = c.stats().unwrap();
    assert_eq!((s.unsealed, s.references), (0, 0), "{s:?}");
    assert!(d.cli(&["stats"]).status.success());

    // Pages again: the same put goes through, into a huge page.
    assert!(pool.set_spare(1), "{:?}", HugePages::now());
    put_ok(&d, &["put", "small", "100000"]);
    assert_eq!(HugePages::now().spare(), 0, "the put took the page");
    let v = c.get_one("small", None).unwrap();
    assert!(v.len() == 100_000 && v.iter().all(|&b| b == 0x5A));
    drop(v);
    let mut d = d;
    assert!(d.child.try_wait().unwrap().is_none(), "the daemon died");
}
