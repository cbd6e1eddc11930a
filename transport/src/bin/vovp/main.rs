//! `vovp`: a command-line client for a running `vovp-engine` (inspection and scripting; the
//! tests' out-of-process client for user-facing commands). `vovp top` is the live view
//! ([`top`]). The test-only commands (holding
//! references, hammering, CUDA checks and measurements) are in the tests' fixture binary,
//! `vovp-fixture` (tests/src/bin/vovp-fixture.rs).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};

mod top;
use serde_json::json;
use vovp_client::{
    Client, CreateOptions, DType, Device, Error, ObjectInfo, Store, StoreStats, TensorMeta,
    TensorView,
};

#[derive(Parser)]
#[command(name = "vovp", version, about = "command-line client of a vovp-engine")]
struct Args {
    /// The daemon's socket.
    #[arg(short = 's', long = "socket", default_value = "/tmp/vovp.sock")]
    socket: PathBuf,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Store bytes (from --data or stdin) under NAME.
    Put {
        name: String,
        #[arg(long)]
        data: Option<String>,
        #[arg(long)]
        ephemeral: bool,
        /// NAME may exist: this put becomes its next version (printed).
        #[arg(long)]
        replace: bool,
    },
    /// Write an object's bytes to stdout.
    Get {
        name: String,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
        /// Only a version above this one (waits up to --timeout-ms for it).
        #[arg(long, default_value_t = 0)]
        newer_than: u64,
    },
    /// Store a tensor: `put-tensor t --dtype float32 --shape 2,3 --values 0,1,2,3,4,5`.
    PutTensor {
        name: String,
        #[arg(long)]
        dtype: String,
        #[arg(long, value_delimiter = ',')]
        shape: Vec<i64>,
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
        values: Vec<f64>,
    },
    /// Print a tensor as JSON: dtype, shape and values.
    GetTensor {
        name: String,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
    },
    /// List the objects: name, dtype, shape, size, state, references.
    List {
        /// One JSON document (an array of objects) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// Show the store's memory, objects, references and connections.
    Stats {
        /// One JSON object with every counter (bytes as plain numbers).
        #[arg(long)]
        json: bool,
    },
    /// Delete NAME (its memory goes when the last holder lets go).
    Delete { name: String },
    /// Evict unreferenced objects until BYTES are freed; prints the bytes freed.
    Evict { bytes: u64 },
    /// A live view, refreshed every second: memory, objects, request rates and latencies,
    /// the clients holding the most, the largest objects. Ctrl-C ends it.
    Top {
        /// Show this many frames, then exit (for scripts; default: until Ctrl-C).
        #[arg(short = 'n', long = "iterations", value_name = "N")]
        iterations: Option<u64>,
        /// Show one frame and exit (as `-n 1`).
        #[arg(long, conflicts_with = "iterations")]
        once: bool,
        /// Seconds between frames.
        #[arg(long, default_value = "1", value_parser = parse_interval)]
        interval: Duration,
        /// Rows of each list (requests, holders, objects).
        #[arg(long, default_value_t = 10)]
        rows: usize,
    },
}

fn parse_interval(s: &str) -> Result<Duration, String> {
    s.parse::<f64>()
        .ok()
        .filter(|v| v.is_finite() && *v >= 0.05)
        .map(Duration::from_secs_f64)
        .ok_or_else(|| format!("{s:?} is not a number of seconds (at least 0.05)"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vovp: {e}");
            ExitCode::FAILURE
        }
    }
}

fn timeout(ms: u64) -> Option<Duration> {
    (ms > 0).then(|| Duration::from_millis(ms))
}

fn run(args: Args) -> Result<(), Error> {
    let mut out = std::io::stdout().lock();
    if let Command::Top {
        iterations,
        once,
        interval,
        rows,
    } = args.command
    {
        // A connection of its own that holds nothing (top.rs).
        let options = top::TopOptions {
            frames: if once { Some(1) } else { iterations },
            interval,
            rows,
        };
        return top::run(&args.socket, &options, &mut out);
    }
    let client = Client::connect(&args.socket)?;
    let io = |e: std::io::Error| Error::Internal(e.to_string());
    match args.command {
        Command::Put {
            name,
            data,
            ephemeral,
            replace,
        } => {
            let bytes = match data {
                Some(d) => d.into_bytes(),
                None => {
                    let mut v = Vec::new();
                    std::io::Read::read_to_end(&mut std::io::stdin(), &mut v).map_err(io)?;
                    v
                }
            };
            let options = CreateOptions {
                ephemeral,
                replace,
                ..Default::default()
            };
            if replace {
                // The version it became, for scripts that publish a name again and again.
                let v = client.put_and_view(&name, &bytes, b"", options)?;
                writeln!(out, "version {}", v.version()).map_err(io)?;
            } else {
                client.put(&name, &bytes, b"", options)?;
                // A small put returns before the store answered: report its outcome first.
                client.sync()?;
            }
        }
        Command::Get {
            name,
            timeout_ms,
            newer_than,
        } => {
            let v = client.get_newer(&name, newer_than, timeout(timeout_ms))?;
            out.write_all(&v).map_err(io)?;
        }
        Command::PutTensor {
            name,
            dtype,
            shape,
            values,
        } => {
            let dtype = DType::from_name(&dtype)?;
            let data = encode_values(dtype, &values)?;
            client.put_tensor(&name, &TensorView::new(dtype, &shape, &data)?)?;
        }
        Command::GetTensor { name, timeout_ms } => {
            let t = client.get_tensor(&name, timeout(timeout_ms))?;
            let values = decode_values(t.dtype(), t.bytes());
            writeln!(
                out,
                "{{\"dtype\": \"{}\", \"shape\": {:?}, \"values\": [{}]}}",
                t.dtype().name(),
                t.shape(),
                values.join(", ")
            )
            .map_err(io)?;
        }
        Command::List { json } => {
            let objects = client.list()?;
            let text = if json {
                list_json(&objects)
            } else {
                list_table(&objects)
            };
            writeln!(out, "{text}").map_err(io)?;
        }
        Command::Stats { json } => {
            let (stats, connections) = client.stats_and_connections()?;
            let text = if json {
                stats_json(&stats, connections)
            } else {
                stats_text(&stats, connections)
            };
            writeln!(out, "{text}").map_err(io)?;
        }
        Command::Delete { name } => client.delete(&name)?,
        Command::Evict { bytes } => writeln!(out, "{}", client.evict(bytes)?).map_err(io)?,
        Command::Top { .. } => unreachable!("answered above"),
    }
    Ok(())
}

/// `1.5 GiB`, `512 B`: bytes for people (binary units, as `-m` takes them).
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// An object's tensor header, if its metadata is one (objects put as raw bytes have none).
fn tensor_of(i: &ObjectInfo) -> Option<TensorMeta> {
    TensorMeta::decode(&i.metadata).ok()
}

fn state_of(i: &ObjectInfo) -> &'static str {
    match (i.sealed, i.ephemeral, i.spilled) {
        (false, _, _) => "unsealed",
        (true, _, true) => "spilled",
        (true, false, false) => "sealed",
        (true, true, false) => "sealed, ephemeral",
    }
}

fn device_name(d: Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(n) => format!("cuda:{n}"),
    }
}

fn list_table(objects: &[ObjectInfo]) -> String {
    let header = ["NAME", "DTYPE", "SHAPE", "SIZE", "DEVICE", "STATE", "REFS"];
    let rows: Vec<[String; 7]> = objects
        .iter()
        .map(|i| {
            let t = tensor_of(i);
            [
                i.name.to_string(),
                t.as_ref().map_or("-".into(), |t| t.dtype.name().into()),
                t.as_ref().map_or("-".into(), |t| format!("{:?}", t.shape)),
                human_bytes(i.size),
                device_name(i.device),
                state_of(i).into(),
                i.refcount.to_string(),
            ]
        })
        .collect();
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(widths)
            .map(|(c, w)| format!("{c:<w$}"))
            .collect();
        padded.join("  ").trim_end().to_string()
    };
    let mut lines = vec![line(header.to_vec())];
    lines.extend(
        rows.iter()
            .map(|r| line(r.iter().map(String::as_str).collect())),
    );
    lines.push(format!("{} objects", objects.len()));
    lines.join("\n")
}

fn list_json(objects: &[ObjectInfo]) -> String {
    let rows: Vec<_> = objects
        .iter()
        .map(|i| {
            let t = tensor_of(i);
            json!({
                "name": i.name.as_str(),
                "size": i.size,
                "dtype": t.as_ref().map(|t| t.dtype.name()),
                "shape": t.as_ref().map(|t| t.shape.clone()),
                "device": device_name(i.device),
                "sealed": i.sealed,
                "ephemeral": i.ephemeral,
                "spilled": i.spilled,
                "refcount": i.refcount,
                "version": i.version,
                "last_access_ms": vovp_client::unix_millis(i.last_access),
            })
        })
        .collect();
    serde_json::Value::Array(rows).to_string()
}

fn stats_text(s: &StoreStats, connections: u64) -> String {
    let percent = |part: u64| match s.capacity {
        0 => 0.0,
        c => part as f64 * 100.0 / c as f64,
    };
    [
        format!("capacity     {}", human_bytes(s.capacity)),
        format!(
            "used         {} ({:.1} %)",
            human_bytes(s.used_bytes),
            percent(s.used_bytes)
        ),
        format!(
            "objects      {} ({} sealed, {} unsealed; {} deleted, waiting for their last holder)",
            s.objects, s.sealed, s.unsealed, s.pending_delete
        ),
        format!(
            "references   {} held by {} holders ({} through hold tables)",
            s.references, s.holders, s.shared_holds
        ),
        format!(
            "connections  {connections} ({} GETs waiting for a seal, {} half-closed)",
            s.waiting_gets, s.half_closed
        ),
        format!("creates      {}", s.creates),
        format!(
            "evicted      {} objects, {}",
            s.evicted_objects,
            human_bytes(s.evicted_bytes)
        ),
        format!(
            "spilled      {} objects, {} on disk now; {} spills ({}), {} restores ({}); \
             {} spill failures, {} restore failures",
            s.spilled_objects,
            human_bytes(s.spilled_bytes),
            s.spills,
            human_bytes(s.spill_bytes),
            s.restores,
            human_bytes(s.restore_bytes),
            s.spill_failures,
            s.restore_failures
        ),
    ]
    .join("\n")
}

fn stats_json(s: &StoreStats, connections: u64) -> String {
    json!({
        "capacity": s.capacity,
        "used_bytes": s.used_bytes,
        "objects": s.objects,
        "sealed": s.sealed,
        "unsealed": s.unsealed,
        "pending_delete": s.pending_delete,
        "references": s.references,
        "holders": s.holders,
        "shared_holds": s.shared_holds,
        "waiting_gets": s.waiting_gets,
        "put_barriers": s.put_barriers,
        "half_closed": s.half_closed,
        "creates": s.creates,
        "evicted_objects": s.evicted_objects,
        "evicted_bytes": s.evicted_bytes,
        "spilled_objects": s.spilled_objects,
        "spilled_bytes": s.spilled_bytes,
        "spills": s.spills,
        "spill_bytes": s.spill_bytes,
        "restores": s.restores,
        "restore_bytes": s.restore_bytes,
        "spill_failures": s.spill_failures,
        "restore_failures": s.restore_failures,
        "connections": connections,
    })
    .to_string()
}

fn encode_values(dtype: DType, values: &[f64]) -> Result<Vec<u8>, Error> {
    let mut b = Vec::with_capacity(values.len() * dtype.itemsize());
    for &v in values {
        match dtype {
            DType::Bool => b.push((v != 0.0) as u8),
            DType::I8 => b.extend((v as i8).to_le_bytes()),
            DType::I16 => b.extend((v as i16).to_le_bytes()),
            DType::I32 => b.extend((v as i32).to_le_bytes()),
            DType::I64 => b.extend((v as i64).to_le_bytes()),
            DType::U8 => b.push(v as u8),
            DType::U16 => b.extend((v as u16).to_le_bytes()),
            DType::U32 => b.extend((v as u32).to_le_bytes()),
            DType::U64 => b.extend((v as u64).to_le_bytes()),
            DType::F32 => b.extend((v as f32).to_le_bytes()),
            DType::F64 => b.extend(v.to_le_bytes()),
            other => {
                return Err(Error::Tensor(format!(
                    "the CLI cannot write {} values",
                    other.name()
                )))
            }
        }
    }
    Ok(b)
}

fn decode_values(dtype: DType, b: &[u8]) -> Vec<String> {
    let n = dtype.itemsize();
    b.chunks_exact(n)
        .map(|c| match dtype {
            DType::Bool => (c[0] != 0).to_string(),
            DType::I8 => (c[0] as i8).to_string(),
            DType::I16 => i16::from_le_bytes([c[0], c[1]]).to_string(),
            DType::I32 => i32::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            DType::I64 => i64::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            DType::U8 => c[0].to_string(),
            DType::U16 => u16::from_le_bytes([c[0], c[1]]).to_string(),
            DType::U32 => u32::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            DType::U64 => u64::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            DType::F32 => f32::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            DType::F64 => f64::from_le_bytes(c.try_into().unwrap_or_default()).to_string(),
            _ => format!(
                "\"0x{}\"",
                c.iter().map(|x| format!("{x:02x}")).collect::<String>()
            ),
        })
        .collect()
}
