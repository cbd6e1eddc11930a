//! Spilling against the real daemon (issue 45): a 64 MiB store taking three times its
//! memory in tensors gives every one back bit-exact, in random order, to several reader
//! processes at once while a writer still puts; a damaged or removed spill file is a typed
//! error naming the object; `--spill-max` falls back to eviction with every put succeeding;
//! a SIGKILLed daemon restarted on the same directory starts clean, and a second daemon on a
//! directory in use is refused. Memory stays within `-m` throughout (the memfds' pages).

use std::path::{Path, PathBuf};
use std::time::Duration;

use vovp::{DType, Error, Store, TensorView};
use vovp_tests::memfd::object_memfd_bytes;
use vovp_tests::{fnv, pattern, Daemon};

const MIB: u64 = 1 << 20;
const PAGE: u64 = 4096;

fn spill_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("vovp-spill-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn spill_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "spill"))
                .collect()
        })
        .unwrap_or_default()
}

/// The size of tensor `i`: most 4 MiB (CREATE), some through the lend (192 KiB), some
/// inline (1 KiB), so every put path spills.
fn size_of(i: u32) -> usize {
    match i % 8 {
        3 => 192 << 10,
        6 => 1 << 10,
        _ => 4 << 20,
    }
}

fn put(client: &vovp_client::Client, name: &str, seed: u32, size: usize) {
    let data = pattern(size, seed);
    let shape = [(size / 4) as i64];
    let view = TensorView::new(DType::F32, &shape, &data).unwrap();
    client.put_tensor(name, &view).unwrap();
}

/// Reader processes: each gets every name in its own random order and prints its bytes' hash.
fn readers(d: &Daemon, names: &[String], processes: usize) -> Vec<std::process::Child> {
    (0..processes)
        .map(|p| {
            let mut order = names.to_vec();
            // A fixed shuffle per process (xorshift), different for each.
            let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (p as u64 + 1);
            for i in (1..order.len()).rev() {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                order.swap(i, (x % (i as u64 + 1)) as usize);
            }
            let mut args = vec!["read"];
            args.extend(order.iter().map(String::as_str));
            d.fixture_spawn(&args)
        })
        .collect()
}

#[test]
fn three_times_the_memory_comes_back_bit_exact_to_several_readers_while_a_writer_puts() {
    let dir = spill_dir("3x");
    let dir_arg = dir.to_str().unwrap();
    let d = Daemon::start_with("64M", &["--spill-dir", dir_arg]);
    let client = d.client();
    let mut names = Vec::new();
    let mut expected = std::collections::HashMap::new();
    let mut total = 0u64;
    let mut i = 0u32;
    while total < 3 * 64 * MIB {
        let name = format!("t{i}");
        put(&client, &name, i, size_of(i));
        expected.insert(name.clone(), fnv(&pattern(size_of(i), i)));
        names.push(name);
        total += size_of(i) as u64;
        i += 1;
    }
    client.sync().unwrap();
    let s = client.stats().unwrap();
    assert_eq!((s.evicted_objects, s.spill_failures), (0, 0), "{s:?}");
    assert!(s.spilled_objects as usize > names.len() / 2, "{s:?}");
    let listed = client.list().unwrap();
    assert_eq!(listed.len(), names.len(), "every object is still listed");
    assert!(listed.iter().filter(|o| o.spilled).count() > names.len() / 2);

    // Three readers in random orders, and a writer still putting beside them.
    let children = readers(&d, &names, 3);
    let writer = std::thread::spawn({
        let socket = d.socket.clone();
        move || {
            let client = vovp_client::Client::connect(&socket).unwrap();
            for j in 0..16u32 {
                put(&client, &format!("w{j}"), 1000 + j, 4 << 20);
            }
            client.sync().unwrap();
        }
    });
    for child in children {
        let out = child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "reader failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let mut seen = 0;
        for line in text.lines() {
            let mut parts = line.split(' ');
            let name = parts.next().unwrap();
            let hash = parts.find_map(|p| p.strip_prefix("fnv=")).unwrap();
            assert_eq!(
                hash,
                format!("{:x}", expected[name]),
                "{name} read back wrong"
            );
            seen += 1;
        }
        assert_eq!(seen, names.len());
    }
    writer.join().unwrap();
    let s = client.stats().unwrap();
    assert!(s.restores > 0 && s.spills > 0, "{s:?}");
    assert_eq!(
        (s.evicted_objects, s.spill_failures, s.restore_failures),
        (0, 0, 0),
        "nothing lost: {s:?}"
    );
    // The writer's objects are all there too, and memory stayed within -m.
    for j in 0..16u32 {
        let t = client.get_tensor(&format!("w{j}"), None).unwrap();
        assert_eq!(fnv(t.bytes()), fnv(&pattern(4 << 20, 1000 + j)));
    }
    let resident = object_memfd_bytes(d.child.id());
    assert!(
        resident <= 64 * MIB + 64 * PAGE,
        "the memfds hold {resident} bytes, more than -m"
    );
    drop(client);
    drop(d);
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Puts 24 MiB into a 16 MiB store: the oldest objects spill.
fn fill(client: &vovp_client::Client) {
    for i in 0..6u32 {
        put(client, &format!("f{i}"), i, 4 << 20);
    }
    client.sync().unwrap();
}

#[test]
fn a_damaged_or_removed_spill_file_is_an_error_naming_the_object() {
    let dir = spill_dir("damaged");
    let d = Daemon::start_with("16M", &["--spill-dir", dir.to_str().unwrap()]);
    let client = d.client();
    fill(&client);
    // The oldest two are spilled (LRU). Their files are named by object id (`{id:016x}.spill`);
    // other files may be there too (spilled ahead of need while their objects stay resident).
    let file_of = |name: &str| {
        let o = client
            .list()
            .unwrap()
            .into_iter()
            .find(|o| o.name.as_str() == name)
            .unwrap_or_else(|| panic!("{name} is gone"));
        assert!(o.spilled, "{name} is not spilled: {o:?}");
        dir.join(format!("{:016x}.spill", o.id.get()))
    };
    let (f0, f1) = (file_of("f0"), file_of("f1"));
    assert!(spill_files(&dir).contains(&f0) && spill_files(&dir).contains(&f1));
    let mut bytes = std::fs::read(&f0).unwrap();
    let at = bytes.len() - 100;
    bytes[at] ^= 0x40;
    std::fs::write(&f0, bytes).unwrap();
    std::fs::remove_file(&f1).unwrap();
    for name in ["f0", "f1"] {
        match client.get_one(name, None) {
            Err(Error::SpillDamaged(m)) => assert!(m.contains(name), "{m}"),
            Err(e) => panic!("{name}: {e:?}"),
            Ok(_) => panic!("{name}: bytes of a damaged file handed out"),
        }
        // The object is gone since.
        assert!(!client.contains(name).unwrap());
    }
    // The CLI says so too, and the count is there.
    let out = d.cli(&["stats", "--json"]);
    let stats: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(stats["restore_failures"], 2);
    // The others come back whole.
    for i in 2..6u32 {
        let v = client.get_one(&format!("f{i}"), None).unwrap();
        assert_eq!(fnv(&v), fnv(&pattern(4 << 20, i)));
    }
    drop(client);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn past_spill_max_the_store_evicts_and_every_put_succeeds() {
    let dir = spill_dir("max");
    let d = Daemon::start_with(
        "16M",
        &["--spill-dir", dir.to_str().unwrap(), "--spill-max", "9M"],
    );
    let client = d.client();
    for i in 0..10u32 {
        put(&client, &format!("m{i}"), i, 4 << 20);
    }
    client.sync().unwrap();
    let s = client.stats().unwrap();
    // Two 4 MiB files fit under 9 MiB (each is a 4 KiB header and the data).
    assert_eq!(s.spilled_objects, 2, "{s:?}");
    assert!(s.spill_failures >= 4, "{s:?}");
    assert_eq!(s.evicted_objects, s.spill_failures);
    let on_disk: u64 = spill_files(&dir)
        .iter()
        .map(|f| f.metadata().unwrap().len())
        .sum();
    assert!(on_disk <= 9 * MIB, "{on_disk} bytes of spill files");
    // The newest object is there; spilled ones come back.
    assert!(client.contains("m9").unwrap());
    drop(client);
    drop(d);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_directory_is_one_daemons_and_a_restart_after_sigkill_starts_clean() {
    let dir = spill_dir("restart");
    let dir_arg = dir.to_str().unwrap().to_owned();
    let first = Daemon::start_with("16M", &["--spill-dir", &dir_arg]);
    let client = first.client();
    fill(&client);
    assert!(!spill_files(&dir).is_empty());
    // A second daemon on the same directory is refused, and touches nothing.
    let files_before = spill_files(&dir).len();
    let second = std::process::Command::new(vovp_tests::bin("vovp-engine"))
        .args(["-m", "16M", "-s"])
        .arg(dir.join("other.sock"))
        .args(["--spill-dir", &dir_arg])
        .output()
        .unwrap();
    assert!(!second.status.success());
    assert!(
        String::from_utf8_lossy(&second.stderr).contains("another vovp-engine"),
        "{}",
        String::from_utf8_lossy(&second.stderr)
    );
    assert_eq!(spill_files(&dir).len(), files_before);
    // SIGKILL: the lock goes with the process; the files stay behind...
    drop(client);
    let mut first = first;
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    assert!(!spill_files(&dir).is_empty());
    // ...and the next daemon on the directory removes them: a restarted store starts empty.
    let again = Daemon::start_with("16M", &["--spill-dir", &dir_arg]);
    vovp_tests::wait_until(Duration::from_secs(10), || spill_files(&dir).is_empty());
    let client = again.client();
    assert!(client.list().unwrap().is_empty());
    assert!(!client.contains("f0").unwrap());
    // And it spills as the first did.
    fill(&client);
    assert!(client.stats().unwrap().spills > 0);
    let v = client.get_one("f0", None).unwrap();
    assert_eq!(fnv(&v), fnv(&pattern(4 << 20, 0)));
    drop(v);
    drop(client);
    // A clean stop takes its files with it.
    assert!(again.terminate().success());
    assert!(spill_files(&dir).is_empty());
    let _ = std::fs::remove_dir_all(&dir);
}
