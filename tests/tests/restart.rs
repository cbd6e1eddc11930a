//! Daemon restarts: clients of a dead daemon get a clear connection error; clients that opted
//! into reconnecting continue on the restarted daemon, where the old objects are not found.

use std::time::Duration;

use vovp::{CreateOptions, Error, Store};
use vovp_client::{Client, ClientOptions};
use vovp_tests::{wait_until, Daemon};

#[test]
fn an_opted_in_client_reconnects_to_a_restarted_daemon() {
    let mut first = Daemon::start("16M");
    let socket = first.socket.clone();
    let plain = first.client();
    let options = ClientOptions {
        reconnect: true,
        ..Default::default()
    };
    let resilient = Client::connect_with(&socket, options).unwrap();
    resilient
        .put("before", b"old bytes", b"", CreateOptions::default())
        .unwrap();
    let held = resilient.get_one("before", None).unwrap();
    let unsealed = resilient
        .create("half", 4, b"", CreateOptions::default())
        .unwrap();

    // The daemon dies; a new one takes over the same socket path.
    first.child.kill().unwrap();
    first.child.wait().unwrap();
    let second = Daemon::start_with_socket("16M", &socket);

    // Without the option: a connection error, every time.
    for _ in 0..2 {
        assert!(matches!(plain.contains("x"), Err(Error::Connection(_))));
    }
    // With it: the next call reconnects; what died with the old daemon is not found.
    assert!(!resilient.contains("before").unwrap());
    assert!(resilient.get(&["before"], None).unwrap()[0].is_none());
    resilient
        .put("after", b"new bytes", b"", CreateOptions::default())
        .unwrap();
    assert_eq!(&resilient.get_one("after", None).unwrap()[..], b"new bytes");
    // A view taken before keeps its own (old, intact) memory; dropping it sends nothing to
    // the new daemon, where its object id could name another object.
    assert_eq!(&held[..], b"old bytes");
    drop(held);
    // An object created on the old daemon cannot be sealed on the new one.
    assert!(matches!(unsealed.seal(), Err(Error::NotFound(_))));
    let watcher = second.client();
    wait_until(Duration::from_secs(10), || {
        let s = watcher.stats().unwrap();
        s.references == 0 && s.objects == 1
    });
    assert_eq!(watcher.list().unwrap()[0].name.as_str(), "after");
}

#[test]
fn the_async_client_reconnects_too() {
    let mut first = Daemon::start("16M");
    let socket = first.socket.clone();
    let rt = vovp_tests::runtime();
    rt.block_on(async {
        use vovp::AsyncStore;
        let plain = vovp_client::AsyncClient::connect(&socket).await.unwrap();
        let c = vovp_client::AsyncClient::connect_with(
            &socket,
            ClientOptions {
                reconnect: true,
                ..Default::default()
            },
        )
        .await
        .unwrap();
        c.put("before", b"x", b"", CreateOptions::default())
            .await
            .unwrap();
        let held = c.get(&["before"], None).await.unwrap().remove(0).unwrap();
        first.child.kill().unwrap();
        first.child.wait().unwrap();
        let second = Daemon::start_with_socket("16M", &socket);
        assert!(matches!(
            plain.contains("before").await,
            Err(Error::Connection(_))
        ));
        assert!(!c.contains("before").await.unwrap());
        c.put("after", &[7u8; 300_000], b"", CreateOptions::default())
            .await
            .unwrap();
        let got = c.get(&["after"], None).await.unwrap().remove(0).unwrap();
        assert_eq!(got.len(), 300_000);
        drop((held, got));
        c.flush().await.unwrap();
        let watcher = second.client();
        wait_until(Duration::from_secs(10), || {
            watcher.stats().unwrap().references == 0
        });
        assert_eq!(watcher.stats().unwrap().objects, 1);
    });
}
