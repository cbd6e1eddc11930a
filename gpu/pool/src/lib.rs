//! The store's device memory, the state behind the GPU actor (`vovp_actors::gpu`): per device,
//! pools of `cuMemAlloc`ed memory cut into blocks ([`Pools`]), and the `--gpu-memory` capacities
//! they are made with ([`GpuConfig`], [`parse_gpu_memory`]). Only the store builds this crate:
//! a client maps the pools' blocks through `vovp_gpu::ipc` and never allocates device memory
//! for objects (`tests/tests/crate_graph.rs` keeps vovp-client and the wheel off it).
//!
//! The driver calls go through `vovp_gpu::primary` (the device's primary context, and the call
//! wrapper that turns failures and cudarc's panics into [`GpuError`]).

#![warn(unreachable_pub, missing_debug_implementations)]

mod pools;

pub use pools::{DeviceUsage, Pools, BLOCK_ALIGN, DEFAULT_FREE_FRACTION_PERCENT};
pub use vovp_gpu::GpuError;

/// Per-device capacity the store may use.
#[derive(Debug, Clone, Default)]
pub struct GpuConfig {
    /// (device ordinal, bytes) pairs, e.g. from `--gpu-memory 0:8G,1:8G`. A device not listed
    /// gets [`DEFAULT_FREE_FRACTION_PERCENT`]% of its free memory at its first request.
    pub capacities: Vec<(u32, u64)>,
}

/// Parses `--gpu-memory`: comma-separated `DEVICE:SIZE` entries such as `0:8G,1:512M`. Sizes are
/// bytes with an optional binary suffix `K`, `M`, `G`, `T` (any case, `B`/`iB` allowed), the same
/// syntax as the host `-m` size. A size of 0 keeps the store off that device.
pub fn parse_gpu_memory(spec: &str) -> Result<Vec<(u32, u64)>, GpuError> {
    let bad = |m: String| GpuError::InvalidConfig(m);
    let mut out: Vec<(u32, u64)> = Vec::new();
    for entry in spec.split(',') {
        let entry = entry.trim();
        let (dev, size) = entry
            .split_once(':')
            .ok_or_else(|| bad(format!("{entry:?} is not DEVICE:SIZE (e.g. 0:8G)")))?;
        let dev: u32 = dev
            .trim()
            .parse()
            .map_err(|_| bad(format!("{dev:?} in {entry:?} is not a device number")))?;
        let size = parse_size(size).ok_or_else(|| {
            bad(format!(
                "{size:?} in {entry:?} is not a size (e.g. 8G, 512M, 1000000)"
            ))
        })?;
        if out.iter().any(|(d, _)| *d == dev) {
            return Err(bad(format!("device {dev} is given twice")));
        }
        out.push((dev, size));
    }
    Ok(out)
}

/// `1000000`, `64K`, `512M`, `1G`, `2T`, `64KiB`; `None` if malformed or over `u64`.
fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .unwrap_or(t);
    let (digits, shift) = match t.chars().last()? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        't' | 'T' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let digits = digits.trim();
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse::<u64>().ok()?.checked_mul(1u64 << shift)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpu_memory_specs() {
        assert_eq!(parse_gpu_memory("0:8G").unwrap(), vec![(0, 8 << 30)]);
        assert_eq!(
            parse_gpu_memory("0:8G,1:512M").unwrap(),
            vec![(0, 8 << 30), (1, 512 << 20)]
        );
        assert_eq!(
            parse_gpu_memory(" 2 : 1T , 3:64KiB,4:1000000,5:0,6:2GB,7:3k").unwrap(),
            vec![
                (2, 1 << 40),
                (3, 64 << 10),
                (4, 1_000_000),
                (5, 0),
                (6, 2 << 30),
                (7, 3 << 10)
            ]
        );
    }

    #[test]
    fn bad_gpu_memory_specs() {
        for spec in [
            "",
            "8G",
            "0",
            "0:",
            ":8G",
            "x:8G",
            "-1:8G",
            "0:8X",
            "0:G",
            "0:-8G",
            "0:1.5G",
            "0:8G,",
            "0:8G,0:4G",
            "0:99999999999T",
            "0:8G;1:8G",
            "4294967296:1G",
        ] {
            match parse_gpu_memory(spec) {
                Err(GpuError::InvalidConfig(m)) => assert!(!m.is_empty(), "{spec:?}"),
                other => panic!("{spec:?} gave {other:?}"),
            }
        }
    }
}
