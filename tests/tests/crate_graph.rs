//! The crate graph keeps the client light: a program that depends on `vovp-client` alone does
//! not build the daemon, tokio-uring or clap.

#[test]
fn the_client_does_not_depend_on_the_daemon() {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = std::process::Command::new(cargo)
        .args([
            "tree",
            "--offline",
            "-p",
            "vovp-client",
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
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree.lines().filter_map(|l| l.split(' ').next()).collect();
    assert!(crates.contains(&"vovp-proto"), "{tree}");
    for banned in ["vovp-transport", "tokio-uring", "clap"] {
        assert!(
            !crates.contains(&banned),
            "vovp-client depends on {banned}:\n{tree}"
        );
    }
}
