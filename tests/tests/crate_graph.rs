//! The crate graph runs one way (ARCHITECTURE.md, "Crates"): the vocabulary at the bottom, the
//! store's actors and engine on one side, the clients on the other. A program that depends on
//! `vovp-client` (and the Python wheel) builds neither the engine, its actors, kameo, the
//! daemon, tokio-uring nor clap, nor the store's device pools (`vovp-gpu-pool`); the wheel
//! builds the client without its `async` feature, so without tokio.

/// The crates `package` depends on (normal dependencies, all depths).
fn dependencies(package: &str) -> Vec<String> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            package,
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("run cargo tree");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.split(' ').next())
        .map(str::to_string)
        .collect()
}

fn assert_none_of(package: &str, banned: &[&str]) {
    let deps = dependencies(package);
    for b in banned {
        assert!(
            !deps.iter().any(|d| d == b),
            "{package} depends on {b}: {deps:?}"
        );
    }
}

#[test]
fn the_clients_build_no_store() {
    let store = [
        "vovp",
        "vovp-actors",
        "kameo",
        "vovp-transport",
        "tokio-uring",
        "clap",
        "vovp-gpu-pool",
        "offset-allocator",
    ];
    assert!(dependencies("vovp-client")
        .iter()
        .any(|d| d == "vovp-proto"));
    assert_none_of("vovp-client", &store);
    assert_none_of("vovp-python", &store);
    // AsyncClient is the only user of tokio on the client side, behind `async`.
    assert!(dependencies("vovp-client").iter().any(|d| d == "tokio"));
    assert_none_of("vovp-python", &["tokio"]);
    // The client side of CUDA (IPC mapping, copies) is theirs; the pools are the store's.
    for client in ["vovp-client", "vovp-python"] {
        assert!(dependencies(client).iter().any(|d| d == "vovp-gpu"));
    }
    assert!(dependencies("vovp-actors")
        .iter()
        .any(|d| d == "vovp-gpu-pool"));
}

#[test]
fn the_vocabulary_is_the_bottom() {
    let deps = dependencies("vovp-types");
    let ours: Vec<_> = deps.iter().filter(|d| d.starts_with("vovp")).collect();
    assert_eq!(ours, ["vovp-types"], "vovp-types depends on {ours:?}");
    // The wire format, shared memory and GPU crates build on the vocabulary only (the pools on
    // the client-side GPU crate too).
    for leaf in ["vovp-proto", "vovp-shm", "vovp-gpu", "vovp-gpu-pool"] {
        assert_none_of(leaf, &["vovp", "vovp-actors", "vovp-client", "kameo"]);
    }
    // The daemon's server does not reach into the client.
    assert_none_of("vovp-actors", &["vovp", "vovp-client", "vovp-proto"]);
}
