//! 8 threads doing mixed operations on overlapping names; afterwards the table is consistent and
//! every byte is back.

use std::time::{Duration, Instant};

use vovp::{Config, CreateOptions, Engine, Error, Store};

#[test]
fn eight_threads_mixed_operations_leave_a_consistent_empty_store() {
    let engine = Engine::spawn(Config::with_capacity(8 << 20)).unwrap();
    let deadline = Instant::now() + Duration::from_secs(3);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let h = engine.session();
            std::thread::spawn(move || {
                let mut rng = t.wrapping_mul(0x9E37_79B9_7F4A_7C15) + 1;
                let mut next = move || {
                    rng ^= rng << 13;
                    rng ^= rng >> 7;
                    rng ^= rng << 17;
                    rng
                };
                let mut held = Vec::new();
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    let name = format!("obj{}", next() % 16);
                    let size = (next() % 200_000) as usize;
                    match next() % 6 {
                        0 => match h.create(&name, size as u64, b"", CreateOptions::default()) {
                            Ok(mut b) => {
                                b.as_mut_slice().fill(t as u8);
                                if next() % 4 == 0 {
                                    drop(b); // abort
                                } else {
                                    held.push(b.seal().unwrap());
                                }
                            }
                            Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                            Err(e) => panic!("create: {e}"),
                        },
                        1 | 2 => {
                            if let Some(v) = h.get(&[&name], None).unwrap().pop().flatten() {
                                // Sealed bytes never change under a holder.
                                let first = v.first().copied();
                                assert!(v.iter().all(|b| Some(*b) == first));
                                held.push(v);
                            }
                        }
                        3 => match h.delete(&name) {
                            Ok(()) | Err(Error::NotFound(_) | Error::NotSealed(_)) => {}
                            Err(e) => panic!("delete: {e}"),
                        },
                        4 => {
                            if !held.is_empty() {
                                let i = next() as usize % held.len();
                                held.swap_remove(i);
                            }
                        }
                        _ => {
                            match h.put(&name, &vec![t as u8; size], b"", CreateOptions::default())
                            {
                                Ok(())
                                | Err(Error::AlreadyExists(_) | Error::OutOfMemory { .. }) => {}
                                Err(e) => panic!("put: {e}"),
                            }
                        }
                    }
                    ops += 1;
                }
                drop(held);
                ops
            })
        })
        .collect();
    let total: u64 = threads.into_iter().map(|t| t.join().unwrap()).sum();
    assert!(total > 1000, "only {total} operations ran");
    // Let the releases from the dropped views land, then delete the survivors.
    for _ in 0..100 {
        if engine.stats().unwrap().references == 0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    for info in engine.list().unwrap() {
        engine.delete(info.name.as_str()).unwrap();
    }
    futures_executor_block_on_check(&engine);
    let s = engine.stats().unwrap();
    assert_eq!(
        (s.objects, s.references, s.used_bytes, s.pending_delete),
        (0, 0, 0, 0),
        "{s:?}"
    );
}

fn futures_executor_block_on_check(engine: &vovp::EngineHandle) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(engine.check_invariants()).unwrap();
}
