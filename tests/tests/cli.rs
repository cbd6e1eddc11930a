//! The `vovp` CLI as people and scripts use it, against a real daemon: readable `list` and
//! `stats` with units, `--json` that parses, and a `--help` that names every command.

use std::process::Command;

use vovp_tests::Daemon;

fn cli(d: &Daemon, args: &[&str]) -> String {
    let out = Command::new(vovp_tests::bin("vovp"))
        .arg("-s")
        .arg(&d.socket)
        .args(args)
        .output()
        .expect("run the vovp CLI");
    assert!(
        out.status.success(),
        "vovp {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).expect("UTF-8 output")
}

fn json(text: &str) -> serde_json::Value {
    serde_json::from_str(text).unwrap_or_else(|e| panic!("not JSON ({e}): {text}"))
}

#[test]
fn list_and_stats_speak_to_people_and_to_scripts() {
    let d = Daemon::start("64M");
    cli(
        &d,
        &[
            "put-tensor",
            "weights",
            "--dtype",
            "float32",
            "--shape",
            "2,3",
            "--values",
            "0,1,2,3,4,5",
        ],
    );
    cli(&d, &["put", "raw", "--data", "hello"]);

    let table = cli(&d, &["list"]);
    let mut lines = table.lines();
    let header: Vec<&str> = lines.next().unwrap().split_whitespace().collect();
    assert_eq!(
        header,
        ["NAME", "DTYPE", "SHAPE", "SIZE", "DEVICE", "STATE", "REFS"]
    );
    let weights = table.lines().find(|l| l.starts_with("weights")).unwrap();
    for cell in ["float32", "[2, 3]", "24 B", "cpu", "sealed"] {
        assert!(weights.contains(cell), "{cell:?} missing: {weights}");
    }
    let raw = table.lines().find(|l| l.starts_with("raw")).unwrap();
    assert!(raw.contains("5 B") && raw.contains(" - "), "{raw}");
    assert!(table.trim_end().ends_with("2 objects"), "{table}");

    let listed = json(&cli(&d, &["list", "--json"]));
    let rows = listed.as_array().expect("an array");
    assert_eq!(rows.len(), 2);
    let w = rows.iter().find(|r| r["name"] == "weights").unwrap();
    assert_eq!(w["dtype"], "float32");
    assert_eq!(w["shape"], serde_json::json!([2, 3]));
    assert_eq!(
        (w["size"].as_u64(), w["sealed"].as_bool()),
        (Some(24), Some(true))
    );
    let r = rows.iter().find(|r| r["name"] == "raw").unwrap();
    assert!(r["dtype"].is_null() && r["shape"].is_null(), "{r}");

    let stats = cli(&d, &["stats"]);
    assert!(stats.contains("capacity     64.0 MiB"), "{stats}");
    assert!(stats.contains("objects      2 (2 sealed"), "{stats}");
    assert!(!stats.contains("StoreStats"), "a Debug dump: {stats}");
    let s = json(&cli(&d, &["stats", "--json"]));
    assert_eq!(s["capacity"].as_u64(), Some(64 << 20));
    assert_eq!(s["objects"].as_u64(), Some(2));
    assert!(s["connections"].as_u64() >= Some(1), "{s}");
}

#[test]
fn help_lists_every_command_with_a_line_each() {
    let out = Command::new(vovp_tests::bin("vovp"))
        .arg("--help")
        .output()
        .expect("run the vovp CLI");
    let help = String::from_utf8_lossy(&out.stdout);
    for command in [
        "put",
        "get",
        "put-tensor",
        "get-tensor",
        "list",
        "stats",
        "delete",
        "evict",
    ] {
        let line = help
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{command} ")))
            .unwrap_or_else(|| panic!("{command} is not listed:\n{help}"));
        let description = line.trim_start()[command.len()..].trim();
        assert!(
            !description.is_empty(),
            "{command} has no description:\n{help}"
        );
    }
}

/// A script publishing a name again and again: `put --replace` prints the version each put
/// became, `get --newer-than` returns only a newer one, and `list --json` shows the version.
#[test]
fn a_script_replaces_a_name_and_follows_its_versions() {
    let d = Daemon::start("16M");
    assert_eq!(
        cli(&d, &["put", "cfg", "--data", "one", "--replace"]),
        "version 1\n"
    );
    assert_eq!(
        cli(&d, &["put", "cfg", "--data", "two", "--replace"]),
        "version 2\n"
    );
    assert_eq!(cli(&d, &["get", "cfg", "--newer-than", "1"]), "two");
    // Nothing newer than 2 within 100 ms: an error that says so, not a hang.
    let out = Command::new(vovp_tests::bin("vovp"))
        .arg("-s")
        .arg(&d.socket)
        .args(["get", "cfg", "--newer-than", "2", "--timeout-ms", "100"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cfg"));
    // Without --replace a taken name is refused, as before.
    let out = Command::new(vovp_tests::bin("vovp"))
        .arg("-s")
        .arg(&d.socket)
        .args(["put", "cfg", "--data", "three"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let listed = json(&cli(&d, &["list", "--json"]));
    assert_eq!(listed[0]["version"], 2);
}
