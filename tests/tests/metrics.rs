//! The metrics of a real daemon (`vovp-engine --metrics`): the port is opened only when asked
//! and where told; scraped values, read with a third-party Prometheus parser, move with the
//! operations made (puts, seals, replaces, deletes, gets over the socket and through the
//! shared directory, lends and publishes, errors, evictions, a client killed while holding
//! references, who holds what by pid), and METRICS answers the same over the socket; bad HTTP is refused while other clients' puts and gets go on; the log
//! carries no colour codes in a file, is JSON with `--log-format json` and names a refused
//! client's pid; `vovp top` shows a frame without a terminal and stops on Ctrl-C.

use std::io::{Read, Write};
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus_parse::{Scrape, Value};
use vovp_client::{CreateOptions, Store};
use vovp_tests::{bin, read_line, wait_until, Daemon};

/// The TCP sockets process `pid` listens on (its fds matched against /proc/net/tcp).
fn listening(pid: u32) -> Vec<SocketAddr> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the daemon's fds")
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter_map(|l| {
            let l = l.to_string_lossy().into_owned();
            Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_owned())
        })
        .collect();
    let mut found = Vec::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let text = std::fs::read_to_string(table).unwrap_or_default();
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // st 0A = LISTEN; column 9 is the inode.
            if cols.len() > 9 && cols[3] == "0A" && inodes.iter().any(|i| i == cols[9]) {
                let (ip, port) = cols[1].split_once(':').expect("local address");
                let port = u16::from_str_radix(port, 16).expect("port");
                let addr = if ip.len() == 8 {
                    let raw = u32::from_str_radix(ip, 16).expect("ipv4");
                    Ipv4Addr::from(raw.swap_bytes()).into()
                } else {
                    std::net::Ipv6Addr::UNSPECIFIED.into()
                };
                found.push(SocketAddr::new(addr, port));
            }
        }
    }
    found
}

/// The metrics address of a daemon started with `--metrics 127.0.0.1:0`.
fn metrics_addr(d: &Daemon) -> SocketAddr {
    let mut addrs = Vec::new();
    wait_until(Duration::from_secs(10), || {
        addrs = listening(d.child.id());
        !addrs.is_empty()
    });
    assert_eq!(addrs.len(), 1, "{addrs:?}");
    addrs[0]
}

fn with_metrics(memory: &str, extra: &[&str]) -> (Daemon, SocketAddr) {
    let mut args = vec!["--metrics", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let d = Daemon::start_with(memory, &args);
    let addr = metrics_addr(&d);
    (d, addr)
}

/// Sends `request` as is and reads the answer to its end (or until the server closes):
/// (status line, whole response). A server that closes without a word gives `("", "")`.
fn http(addr: SocketAddr, request: &[u8]) -> (String, String) {
    let mut s = TcpStream::connect(addr).expect("connect to the metrics port");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    // The server may close before it has read everything (a refused head): ignore that.
    let _ = s.write_all(request);
    let mut response = Vec::new();
    let _ = s.read_to_end(&mut response);
    let text = String::from_utf8_lossy(&response).into_owned();
    let status = text.lines().next().unwrap_or("").to_owned();
    (status, text)
}

fn get(addr: SocketAddr, path: &str) -> (String, String) {
    http(
        addr,
        format!("GET {path} HTTP/1.1\r\nHost: vovp\r\nConnection: close\r\n\r\n").as_bytes(),
    )
}

fn scrape(addr: SocketAddr) -> Scrape {
    let (status, text) = get(addr, "/metrics");
    assert_eq!(status, "HTTP/1.1 200 OK", "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("content-type: text/plain; version=0.0.4"),
        "{text}"
    );
    let body = text.split_once("\r\n\r\n").expect("a body").1;
    Scrape::parse(body.lines().map(|l| Ok(l.to_owned()))).expect("a Prometheus text page")
}

/// The value of the sample `name` with `labels` (counter, gauge or untyped).
fn value(s: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
    let sample = s
        .samples
        .iter()
        .find(|x| x.metric == name && labels.iter().all(|(k, v)| x.labels.get(k) == Some(v)))
        .unwrap_or_else(|| panic!("no sample {name}{labels:?}"));
    match sample.value {
        Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => v,
        ref other => panic!("{name}: {other:?}"),
    }
}

#[test]
fn the_port_is_opened_only_when_asked_and_where_told() {
    let plain = Daemon::start("16M");
    // Give a started endpoint time to show: none may.
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        listening(plain.child.id()),
        vec![],
        "a port without --metrics"
    );

    // A port known to be free a moment ago.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port();
    let told = format!("127.0.0.1:{port}");
    let d = Daemon::start_with("16M", &["--metrics", &told]);
    let addr = metrics_addr(&d);
    assert_eq!(addr, told.parse::<SocketAddr>().unwrap());
    assert_eq!(
        value(&scrape(addr), "vovp_capacity_bytes", &[]),
        16.0 * 1048576.0
    );

    // A port that cannot be bound stops the start, with the reason.
    let out = Command::new(bin("vovp-engine"))
        .args(["-m", "16M", "-s"])
        .arg(std::env::temp_dir().join(format!("vovp-metrics-taken-{}", std::process::id())))
        .args(["--metrics", &told])
        .output()
        .expect("run vovp-engine");
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--metrics"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn scraped_values_move_with_puts_gets_errors_and_evictions() {
    // Every get a message, so that GETs show in the request counts.
    let (d, addr) = with_metrics("16M", &["--no-shared-reads"]);
    let before = scrape(addr);
    assert_eq!(value(&before, "vovp_objects", &[("state", "sealed")]), 0.0);
    assert_eq!(value(&before, "vovp_creates_total", &[]), 0.0);

    let client = d.client();
    let data = [7u8; 64];
    for i in 0..10 {
        client
            .put(&format!("small{i}"), &data, b"", CreateOptions::default())
            .unwrap();
    }
    client.sync().unwrap();
    let views: Vec<_> = (0..5)
        .map(|i| client.get_one(&format!("small{i}"), None).unwrap())
        .collect();
    assert!(client.delete("missing").is_err());
    // One name missing from a get, one deleted, one replaced.
    assert!(client.get(&["small0", "absent"], None).unwrap()[1].is_none());
    client.delete("small9").unwrap();
    client
        .put(
            "small8",
            &[1u8; 32],
            b"",
            CreateOptions {
                replace: true,
                ..Default::default()
            },
        )
        .unwrap();
    client.sync().unwrap();
    let s = scrape(addr);
    assert_eq!(value(&s, "vovp_seals_total", &[]), 11.0);
    assert_eq!(value(&s, "vovp_sealed_bytes_total", &[]), 672.0);
    assert_eq!(value(&s, "vovp_replaces_total", &[]), 1.0);
    assert_eq!(value(&s, "vovp_replaced_bytes_total", &[]), 32.0);
    assert_eq!(value(&s, "vovp_deletes_total", &[]), 1.0);
    assert_eq!(value(&s, "vovp_deleted_bytes_total", &[]), 64.0);
    let gets = |s: &Scrape, result| value(s, "vovp_socket_gets_total", &[("result", result)]);
    assert_eq!((gets(&s, "hit"), gets(&s, "miss")), (6.0, 1.0));
    assert_eq!(value(&s, "vovp_socket_get_bytes_total", &[]), 6.0 * 64.0);
    assert_eq!(
        value(&s, "vovp_shared_gets_total", &[]),
        0.0,
        "no directory"
    );
    assert!(value(&s, "vovp_resident_bytes", &[]) >= value(&s, "vovp_used_bytes", &[]));
    // This client holds the five views: 5 references of 64 bytes, by its pid.
    let me = std::process::id().to_string();
    assert_eq!(
        value(&s, "vovp_client_references", &[("pid", me.as_str())]),
        5.0
    );
    assert_eq!(
        value(&s, "vovp_client_held_bytes", &[("pid", me.as_str())]),
        320.0
    );
    assert_eq!(value(&s, "vovp_objects", &[("state", "sealed")]), 9.0);
    assert!(value(&s, "vovp_creates_total", &[]) >= 11.0);
    assert!(value(&s, "vovp_used_bytes", &[]) >= 9.0 * 64.0);
    assert!(value(&s, "vovp_references", &[]) >= 5.0);
    assert!(value(&s, "vovp_holders", &[]) >= 1.0);
    assert_eq!(value(&s, "vovp_connections", &[]), 1.0);
    assert!(value(&s, "vovp_connections_opened_total", &[]) >= 1.0);
    let count = |s: &Scrape, op| value(s, "vovp_request_duration_seconds_count", &[("op", op)]);
    assert!(count(&s, "PUT") >= 10.0, "{}", count(&s, "PUT"));
    assert!(count(&s, "GET") >= 6.0);
    assert!(value(&s, "vovp_request_errors_total", &[("status", "NOT_FOUND")]) >= 1.0);
    assert!(value(&s, "vovp_socket_received_bytes_total", &[]) > 640.0);
    assert!(value(&s, "vovp_socket_sent_bytes_total", &[]) > 0.0);
    // The histogram parses as one: buckets ascending to +Inf, whose count is _count's.
    let get_latencies = s
        .samples
        .iter()
        .find(|x| x.metric == "vovp_request_duration_seconds" && x.labels.get("op") == Some("GET"))
        .expect("GET's histogram");
    let Value::Histogram(buckets) = &get_latencies.value else {
        panic!("{:?}", get_latencies.value)
    };
    assert!(buckets
        .windows(2)
        .all(|w| w[0].less_than < w[1].less_than && w[0].count <= w[1].count));
    let last = buckets.last().unwrap();
    assert_eq!(
        (last.less_than, last.count),
        (f64::INFINITY, count(&s, "GET"))
    );
    drop(views);

    // Evictions: 24 objects of 1 MiB through a 16 MiB store.
    let big = vec![1u8; 1 << 20];
    for i in 0..24 {
        client
            .put(&format!("big{i}"), &big, b"", CreateOptions::default())
            .unwrap();
    }
    let s = scrape(addr);
    assert!(value(&s, "vovp_evicted_objects_total", &[]) >= 1.0);
    assert!(value(&s, "vovp_evicted_bytes_total", &[]) >= f64::from(1 << 20));
    assert!(value(&s, "vovp_used_bytes", &[]) <= value(&s, "vovp_capacity_bytes", &[]));
}

#[test]
fn a_client_killed_while_holding_references_drops_out_of_the_metrics() {
    let (d, addr) = with_metrics("16M", &[]);
    let client = d.client();
    for name in ["held-a", "held-b"] {
        client
            .put(name, b"bytes", b"", CreateOptions::default())
            .unwrap();
    }
    client.sync().unwrap();
    let idle = scrape(addr);
    let idle_refs = value(&idle, "vovp_references", &[]);
    let idle_holders = value(&idle, "vovp_holders", &[]);
    let mut holder = d.fixture_spawn(&["hold", "held-a", "held-b"]);
    assert_eq!(read_line(&mut holder), "holding");
    let held = scrape(addr);
    assert_eq!(value(&held, "vovp_references", &[]), idle_refs + 2.0);
    assert_eq!(value(&held, "vovp_holders", &[]), idle_holders + 1.0);
    // The holder by its pid: two objects of 5 bytes, through its hold table.
    let pid = holder.id().to_string();
    let of_holder = |s: &Scrape, name: &str| {
        s.samples
            .iter()
            .find(|x| x.metric == name && x.labels.get("pid") == Some(pid.as_str()))
            .map(|x| x.value.clone())
    };
    assert_eq!(
        of_holder(&held, "vovp_client_references"),
        Some(Value::Gauge(2.0))
    );
    assert_eq!(
        of_holder(&held, "vovp_client_held_bytes"),
        Some(Value::Gauge(10.0))
    );
    let connections = value(&held, "vovp_connections", &[]);
    holder.kill().expect("kill the holder");
    holder.wait().expect("reap the holder");
    wait_until(Duration::from_secs(10), || {
        let s = scrape(addr);
        value(&s, "vovp_references", &[]) == idle_refs
            && value(&s, "vovp_holders", &[]) == idle_holders
            && value(&s, "vovp_connections", &[]) == connections - 1.0
    });
    let after = scrape(addr);
    assert!(value(&after, "vovp_connections_closed_total", &[]) >= 1.0);
    assert_eq!(of_holder(&after, "vovp_client_references"), None);
    assert_eq!(of_holder(&after, "vovp_client_held_bytes"), None);
    // Its two gets through the directory stay counted after it went.
    assert!(value(&after, "vovp_shared_gets_total", &[]) >= 2.0);
}

#[test]
fn directory_gets_lends_and_publishes_are_counted_and_metrics_come_over_the_socket_too() {
    let (d, addr) = with_metrics("64M", &[]);
    let client = d.client();
    // 100 KiB: a put through a lend (a LEND, then a PUBLISH), gets through the directory.
    let big = vec![3u8; 100 << 10];
    client
        .put("lent", &big, b"", CreateOptions::default())
        .unwrap();
    client.sync().unwrap();
    for _ in 0..3 {
        let view = client.get_one("lent", None).unwrap();
        assert_eq!(view.len(), big.len());
    }
    let s = scrape(addr);
    assert!(value(&s, "vovp_lends_made_total", &[]) >= 1.0);
    assert!(value(&s, "vovp_lent_bytes_total", &[]) >= big.len() as f64);
    assert!(value(&s, "vovp_lends", &[]) >= 1.0);
    assert_eq!(value(&s, "vovp_publishes_total", &[]), 1.0);
    assert_eq!(
        value(&s, "vovp_published_bytes_total", &[]),
        big.len() as f64
    );
    assert_eq!(value(&s, "vovp_shared_gets_total", &[]), 3.0);
    assert_eq!(
        value(&s, "vovp_shared_get_bytes_total", &[]),
        3.0 * big.len() as f64
    );
    assert_eq!(
        value(&s, "vovp_socket_gets_total", &[("result", "hit")]),
        0.0,
        "no get took the socket"
    );

    // The same numbers through METRICS on the client's own connection.
    let text = client.metrics().unwrap();
    let over_socket = Scrape::parse(text.lines().map(|l| Ok(l.to_owned()))).unwrap();
    assert_eq!(value(&over_socket, "vovp_shared_gets_total", &[]), 3.0);
    assert_eq!(value(&over_socket, "vovp_publishes_total", &[]), 1.0);

    // A client gone: its count is kept, never lost nor counted twice.
    drop(client);
    wait_until(Duration::from_secs(10), || {
        value(&scrape(addr), "vovp_connections", &[]) == 0.0
    });
    let other = d.client();
    drop(other.get_one("lent", None).unwrap());
    let s = scrape(addr);
    assert_eq!(value(&s, "vovp_shared_gets_total", &[]), 4.0);
}

#[test]
fn bad_http_is_refused_while_the_store_keeps_serving() {
    let (d, addr) = with_metrics("64M", &[]);
    // Another client puts and gets all along; it must never fail nor stall.
    let stop = Arc::new(AtomicBool::new(false));
    let ops = Arc::new(AtomicU64::new(0));
    let worker = {
        let (stop, ops) = (stop.clone(), ops.clone());
        let client = d.client();
        std::thread::spawn(move || {
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let name = format!("w{}", i % 64);
                client
                    .put(
                        &name,
                        &i.to_le_bytes(),
                        b"",
                        CreateOptions {
                            replace: true,
                            ..Default::default()
                        },
                    )
                    .expect("put during the bad requests");
                let view = client
                    .get_one(&name, Some(Duration::from_secs(5)))
                    .expect("get");
                assert_eq!(view.len(), 8);
                ops.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
        })
    };
    wait_until(Duration::from_secs(10), || ops.load(Ordering::Relaxed) > 10);

    // A head over 8 KiB: 431, closed.
    let huge = format!(
        "GET /metrics HTTP/1.1\r\nHost: vovp\r\nX-Padding: {}\r\n\r\n",
        "a".repeat(16 * 1024)
    );
    let (status, _) = http(addr, huge.as_bytes());
    assert!(status.contains(" 431 "), "{status:?}");
    // Not HTTP: 400, closed.
    let (status, _) = http(addr, b"\x00\x01 hello\r\n\r\n");
    assert!(status.contains(" 400 "), "{status:?}");
    // Anything but GET /metrics.
    assert!(get(addr, "/").0.contains(" 404 "));
    let (status, text) = http(
        addr,
        b"POST /metrics HTTP/1.1\r\nHost: v\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
    );
    assert!(
        status.contains(" 405 ") && text.to_ascii_lowercase().contains("allow: get"),
        "{text}"
    );

    // A head that never ends is closed within the head timeout; the store serves meanwhile.
    let mut slow = TcpStream::connect(addr).unwrap();
    slow.write_all(b"GET /metr").unwrap();
    slow.set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    let (started, ops_then) = (Instant::now(), ops.load(Ordering::Relaxed));
    let mut rest = Vec::new();
    let _ = slow.read_to_end(&mut rest);
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(15),
        "a slow head held for {waited:?}"
    );
    assert!(
        ops.load(Ordering::Relaxed) > ops_then,
        "the store stalled during a slow head"
    );

    // More connections than the endpoint serves at once: the extra ones are closed at once,
    // and once they go the endpoint answers again.
    let idle: Vec<TcpStream> = (0..24).map(|_| TcpStream::connect(addr).unwrap()).collect();
    let closed_at_once = idle
        .iter()
        .filter(|s| {
            s.set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            matches!((&**s).read(&mut [0u8; 1]), Ok(0))
        })
        .count();
    assert!(closed_at_once >= 24 - 16, "{closed_at_once} closed of 24");
    drop(idle);
    wait_until(Duration::from_secs(10), || {
        get(addr, "/metrics").0 == "HTTP/1.1 200 OK"
    });

    stop.store(true, Ordering::Relaxed);
    worker
        .join()
        .expect("the worker's puts and gets all succeeded");
    let s = scrape(addr);
    assert!(value(&s, "vovp_objects", &[("state", "sealed")]) >= 1.0);
}

/// A daemon started here (not through `Daemon`) with its stderr in a file.
struct Logged {
    child: std::process::Child,
    log: std::path::PathBuf,
    socket: std::path::PathBuf,
}

impl Logged {
    fn start(name: &str, extra: &[&str]) -> Logged {
        let dir = std::env::temp_dir().join(format!("vovp-metrics-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (log, socket) = (dir.join("engine.log"), dir.join("vovp.sock"));
        let child = Command::new(bin("vovp-engine"))
            .args(["-m", "16M", "--log-level", "info", "-s"])
            .arg(&socket)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn vovp-engine");
        wait_until(Duration::from_secs(20), || {
            std::os::unix::net::UnixStream::connect(&socket).is_ok()
        });
        Logged { child, log, socket }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for Logged {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(dir) = self.log.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

#[test]
fn the_bound_port_is_logged_and_the_log_has_no_colour_codes_in_a_file() {
    let d = Logged::start("text", &["--metrics", "127.0.0.1:0"]);
    let mut logged = None;
    wait_until(Duration::from_secs(10), || {
        logged = d
            .log()
            .split_whitespace()
            .find_map(|w| w.strip_prefix("metrics_addr=")?.parse::<SocketAddr>().ok());
        logged.is_some()
    });
    let logged = logged.unwrap();
    assert_eq!(listening(d.child.id()), vec![logged]);
    assert!(value(&scrape(logged), "vovp_capacity_bytes", &[]) > 0.0);
    assert!(
        !d.log().contains('\x1b'),
        "colour codes in a file:\n{}",
        d.log()
    );
}

#[test]
fn json_logs_name_the_pid_of_a_refused_client() {
    let d = Logged::start("json", &["--log-format", "json", "--max-connections", "1"]);
    // The readiness probe's connection may still count for a moment: retry until it is gone.
    let mut first = None;
    wait_until(Duration::from_secs(10), || {
        first = vovp_client::Client::connect(&d.socket).ok();
        first.is_some()
    });
    // The second is over the limit: refused, and the warning names its pid (ours).
    assert!(vovp_client::Client::connect(&d.socket).is_err());
    let mut lines = Vec::new();
    wait_until(Duration::from_secs(10), || {
        lines = d.log().lines().map(str::to_owned).collect();
        lines.iter().any(|l| l.contains("WARN"))
    });
    for line in &lines {
        let v: serde_json::Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        assert!(
            v["level"].is_string() && v["fields"]["message"].is_string(),
            "{line}"
        );
    }
    let warning = lines
        .iter()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["level"] == "WARN")
        .unwrap();
    assert_eq!(
        warning["fields"]["pid"],
        i64::from(std::process::id() as i32),
        "{warning}"
    );
    drop(first);
}

#[test]
fn vovp_top_shows_frames_without_a_terminal_and_stops_on_ctrl_c() {
    let d = Daemon::start("16M");
    let client = d.client();
    client
        .put(
            "a-large-one",
            &vec![0u8; 100_000],
            b"",
            CreateOptions::default(),
        )
        .unwrap();
    client
        .put("small", b"x", b"", CreateOptions::default())
        .unwrap();
    client.sync().unwrap();

    let once = d.cli(&["top", "--once"]);
    assert!(
        once.status.success(),
        "{}",
        String::from_utf8_lossy(&once.stderr)
    );
    let text = String::from_utf8(once.stdout).unwrap();
    assert!(
        !text.contains('\x1b'),
        "terminal codes into a pipe:\n{text}"
    );
    for part in [
        "memory   [",
        "objects  2: 2 sealed",
        "REQUEST",
        "LARGEST OBJECTS",
    ] {
        assert!(text.contains(part), "{part:?} missing:\n{text}");
    }
    let largest = text.split("LARGEST OBJECTS").nth(1).unwrap();
    let first_object = largest.lines().nth(1).unwrap();
    assert!(
        first_object.starts_with("a-large-one") && first_object.contains("97.7 KiB"),
        "{largest}"
    );

    let two = d.cli(&["top", "-n", "2", "--interval", "0.2"]);
    let text = String::from_utf8(two.stdout).unwrap();
    assert_eq!(text.matches("vovp top ").count(), 2, "{text}");
    let second = text.rsplit("vovp top ").next().unwrap();
    let stats = second
        .lines()
        .find(|l| l.starts_with("STATS"))
        .expect("STATS asked");
    assert!(stats.contains("/s"), "a rate over the interval: {stats}");

    // Until Ctrl-C: the first frame, then SIGINT, then a clean exit.
    let mut live = d.cli_spawn(&["top"]);
    assert!(read_line(&mut live).starts_with("vovp top"));
    // SAFETY: kill(2) on our own child.
    unsafe { libc::kill(live.id() as i32, libc::SIGINT) };
    let started = Instant::now();
    let status = loop {
        if let Some(s) = live.try_wait().unwrap() {
            break s;
        }
        assert!(
            started.elapsed() < Duration::from_secs(5),
            "top ignored Ctrl-C"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status}");
}

#[test]
fn the_grafana_dashboard_names_only_metrics_the_daemon_reports() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../ops/grafana-vovp.json");
    let dashboard: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("ops/grafana-vovp.json"))
            .expect("the dashboard is JSON");
    let (d, addr) = with_metrics("16M", &[]);
    // A client holding an object: the per-client families have a series only then.
    let client = d.client();
    client
        .put("held", b"bytes", b"", CreateOptions::default())
        .unwrap();
    let _view = client.get_one("held", None).unwrap();
    let (_, page) = get(addr, "/metrics");
    let reported: Vec<&str> = page
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let mut named = 0;
    for panel in dashboard["panels"].as_array().expect("panels") {
        for target in panel["targets"].as_array().expect("targets") {
            let expr = target["expr"].as_str().expect("an expression");
            for word in expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')) {
                if word.starts_with("vovp_") {
                    named += 1;
                    assert!(
                        reported.contains(&word),
                        "{word} (in {expr:?}) is not reported"
                    );
                }
            }
        }
    }
    assert!(named >= 20, "{named} metric names in the dashboard");
}
