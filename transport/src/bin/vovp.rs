//! `vovp`: a command-line client for a running `vovp-engine` (inspection and scripting; the
//! tests' out-of-process client for user-facing commands). The test-only commands (holding
//! references, hammering, CUDA checks and measurements) are in the tests' fixture binary,
//! `vovp-fixture` (tests/src/bin/vovp-fixture.rs).

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use vovp::{CreateOptions, DType, Error, Store, TensorView};
use vovp_client::Client;

#[derive(Parser)]
#[command(name = "vovp", version, about = "command-line client of a vovp-engine")]
struct Args {
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
    },
    /// Write an object's bytes to stdout.
    Get {
        name: String,
        #[arg(long, default_value_t = 0)]
        timeout_ms: u64,
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
    List,
    Stats,
    Delete {
        name: String,
    },
    Evict {
        bytes: u64,
    },
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
    let client = Client::connect(&args.socket)?;
    let mut out = std::io::stdout().lock();
    let io = |e: std::io::Error| Error::Internal(e.to_string());
    match args.command {
        Command::Put {
            name,
            data,
            ephemeral,
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
                ..Default::default()
            };
            client.put(&name, &bytes, b"", options)?;
            // A small put returns before the store answered: report its outcome before exiting.
            client.sync()?;
        }
        Command::Get { name, timeout_ms } => {
            let v = client.get_one(&name, timeout(timeout_ms))?;
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
        Command::List => {
            for i in client.list()? {
                writeln!(
                    out,
                    "{}\t{} bytes\t{}\trefs={}{}",
                    i.name,
                    i.size,
                    if i.sealed { "sealed" } else { "unsealed" },
                    i.refcount,
                    if i.ephemeral { "\tephemeral" } else { "" }
                )
                .map_err(io)?;
            }
        }
        Command::Stats => {
            let s = client.stats()?;
            writeln!(out, "{s:#?}\nconnections: {}", client.connections()?).map_err(io)?;
        }
        Command::Delete { name } => client.delete(&name)?,
        Command::Evict { bytes } => writeln!(out, "{}", client.evict(bytes)?).map_err(io)?,
    }
    Ok(())
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
