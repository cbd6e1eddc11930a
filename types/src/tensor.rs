//! Tensors by name: the versioned metadata header (dtype, shape, byte order, device) stored with
//! each tensor object, shared with the Python client. Layout in PROTOCOL.md ("Tensor metadata").

use crate::Device;
use crate::{Error, ObjectView};

const MAGIC: &[u8; 4] = b"VTNS";
const VERSION: u8 = 1;
const HEADER_LEN: usize = 16;
/// Most dimensions a tensor header may have (numpy's limit; more than PyTorch allows).
pub const MAX_NDIM: usize = 64;

/// Element types: the DLPack set.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    Bool = 1,
    I8 = 2,
    I16 = 3,
    I32 = 4,
    I64 = 5,
    U8 = 6,
    U16 = 7,
    U32 = 8,
    U64 = 9,
    F16 = 10,
    BF16 = 11,
    F32 = 12,
    F64 = 13,
    C64 = 14,
    C128 = 15,
}

impl DType {
    pub const ALL: [DType; 15] = [
        DType::Bool,
        DType::I8,
        DType::I16,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::F16,
        DType::BF16,
        DType::F32,
        DType::F64,
        DType::C64,
        DType::C128,
    ];

    pub fn itemsize(self) -> usize {
        match self {
            DType::Bool | DType::I8 | DType::U8 => 1,
            DType::I16 | DType::U16 | DType::F16 | DType::BF16 => 2,
            DType::I32 | DType::U32 | DType::F32 => 4,
            DType::I64 | DType::U64 | DType::F64 | DType::C64 => 8,
            DType::C128 => 16,
        }
    }

    pub fn from_code(code: u8) -> Result<Self, Error> {
        DType::ALL
            .into_iter()
            .find(|d| *d as u8 == code)
            .ok_or_else(|| Error::Tensor(format!("unknown dtype code {code}")))
    }

    /// numpy-style name (`float32`, `bfloat16`, ...).
    pub fn name(self) -> &'static str {
        match self {
            DType::Bool => "bool",
            DType::I8 => "int8",
            DType::I16 => "int16",
            DType::I32 => "int32",
            DType::I64 => "int64",
            DType::U8 => "uint8",
            DType::U16 => "uint16",
            DType::U32 => "uint32",
            DType::U64 => "uint64",
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F32 => "float32",
            DType::F64 => "float64",
            DType::C64 => "complex64",
            DType::C128 => "complex128",
        }
    }

    pub fn from_name(name: &str) -> Result<Self, Error> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == name)
            .ok_or_else(|| Error::Tensor(format!("unknown dtype {name:?}")))
    }
}

/// A tensor's description: what `get_tensor` needs besides the bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorMeta {
    pub dtype: DType,
    pub shape: Vec<i64>,
    pub device: Device,
    pub little_endian: bool,
}

impl TensorMeta {
    pub fn numel(&self) -> u64 {
        self.shape.iter().map(|&d| d.max(0) as u64).product()
    }

    /// Data bytes of a C-contiguous tensor with this description.
    pub fn nbytes(&self) -> u64 {
        self.numel() * self.dtype.itemsize() as u64
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(HEADER_LEN + 8 * self.shape.len());
        b.extend_from_slice(MAGIC);
        b.push(VERSION);
        b.push(self.dtype as u8);
        let (dev_type, dev_id) = match self.device {
            Device::Cpu => (1u8, 0u32),
            Device::Cuda(n) => (2, n),
        };
        b.push(dev_type);
        b.push(if self.little_endian { 0 } else { 1 });
        b.extend_from_slice(&dev_id.to_le_bytes());
        b.extend_from_slice(&(self.shape.len() as u32).to_le_bytes());
        for d in &self.shape {
            b.extend_from_slice(&d.to_le_bytes());
        }
        b
    }

    pub fn decode(b: &[u8]) -> Result<Self, Error> {
        let bad = |why: &str| Error::Tensor(format!("not a vovp tensor header: {why}"));
        if b.len() < HEADER_LEN || &b[..4] != MAGIC {
            return Err(bad("missing magic"));
        }
        if b[4] != VERSION {
            return Err(bad(&format!(
                "header version {} (this build reads 1)",
                b[4]
            )));
        }
        let dtype = DType::from_code(b[5])?;
        let dev_id = u32::from_le_bytes([b[8], b[9], b[10], b[11]]);
        let device = match b[6] {
            1 => Device::Cpu,
            2 => Device::Cuda(dev_id),
            other => return Err(bad(&format!("device type {other}"))),
        };
        let little_endian = match b[7] {
            0 => true,
            1 => false,
            other => return Err(bad(&format!("byte order {other}"))),
        };
        let ndim = u32::from_le_bytes([b[12], b[13], b[14], b[15]]) as usize;
        // Bytes after the shape are optional extension fields (PROTOCOL.md; the first is the
        // framework the data came from, written by the Python client): not needed here.
        if ndim > MAX_NDIM || b.len() < HEADER_LEN + 8 * ndim {
            return Err(bad("shape length"));
        }
        let mut shape = Vec::with_capacity(ndim);
        for c in b[HEADER_LEN..HEADER_LEN + 8 * ndim].chunks_exact(8) {
            let d = i64::from_le_bytes(c.try_into().expect("chunk of 8"));
            if d < 0 {
                return Err(bad("negative dimension"));
            }
            shape.push(d);
        }
        Ok(TensorMeta {
            dtype,
            shape,
            device,
            little_endian,
        })
    }
}

/// A borrowed C-contiguous host tensor to put.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub dtype: DType,
    pub shape: &'a [i64],
    pub data: &'a [u8],
}

impl<'a> TensorView<'a> {
    /// Checks that `data` holds exactly `shape`'s elements.
    pub fn new(dtype: DType, shape: &'a [i64], data: &'a [u8]) -> Result<Self, Error> {
        let meta = TensorMeta {
            dtype,
            shape: shape.to_vec(),
            device: Device::Cpu,
            little_endian: cfg!(target_endian = "little"),
        };
        if shape.iter().any(|&d| d < 0) || meta.nbytes() != data.len() as u64 {
            return Err(Error::Tensor(format!(
                "{} bytes do not hold a {} tensor of shape {shape:?}",
                data.len(),
                dtype.name()
            )));
        }
        Ok(TensorView { dtype, shape, data })
    }

    pub fn meta(&self) -> TensorMeta {
        TensorMeta {
            dtype: self.dtype,
            shape: self.shape.to_vec(),
            device: Device::Cpu,
            little_endian: cfg!(target_endian = "little"),
        }
    }
}

/// Element types readable in place from a [`Tensor`].
pub trait Element: Copy + 'static {
    const DTYPE: DType;
}
macro_rules! element {
    ($($t:ty => $d:ident),*) => { $(impl Element for $t { const DTYPE: DType = DType::$d; })* };
}
element!(i8 => I8, i16 => I16, i32 => I32, i64 => I64, u8 => U8, u16 => U16, u32 => U32,
         u64 => U64, f32 => F32, f64 => F64);

/// A tensor got from the store: zero-copy over the object's memory; releases on drop.
#[derive(Debug)]
pub struct Tensor {
    pub meta: TensorMeta,
    pub object: ObjectView,
}

impl Tensor {
    pub fn from_view(object: ObjectView) -> Result<Self, Error> {
        let meta = TensorMeta::decode(object.metadata())?;
        if meta.nbytes() != object.size() {
            return Err(Error::Tensor(format!(
                "object {} holds {} bytes but its header says {}",
                object.name(),
                object.size(),
                meta.nbytes()
            )));
        }
        Ok(Tensor { meta, object })
    }

    pub fn dtype(&self) -> DType {
        self.meta.dtype
    }
    pub fn shape(&self) -> &[i64] {
        &self.meta.shape
    }
    /// The bytes of a host tensor (empty for a CUDA tensor: see [`Tensor::cuda_ptr`]).
    pub fn bytes(&self) -> &[u8] {
        self.object.bytes()
    }

    /// The device address of a CUDA tensor in this process.
    pub fn cuda_ptr(&self) -> Option<u64> {
        self.object.cuda_ptr()
    }

    /// The elements as `T`, in place (the store aligns data to 64 bytes).
    pub fn as_slice<T: Element>(&self) -> Result<&[T], Error> {
        if T::DTYPE != self.meta.dtype {
            return Err(Error::Tensor(format!(
                "tensor is {}, not {}",
                self.meta.dtype.name(),
                T::DTYPE.name()
            )));
        }
        let b = self.object.bytes();
        if b.is_empty() {
            return Ok(&[]);
        }
        if !(b.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()) {
            return Err(Error::Tensor("data is not aligned for its dtype".into()));
        }
        // SAFETY: dtype matches T, the length is a whole number of elements (checked at
        // construction) and the pointer is aligned (checked above).
        Ok(unsafe {
            std::slice::from_raw_parts(b.as_ptr() as *const T, b.len() / std::mem::size_of::<T>())
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_every_dtype_and_rank() {
        for dtype in DType::ALL {
            for shape in [vec![], vec![0], vec![2, 3], vec![1, 1, 1, 7]] {
                let m = TensorMeta {
                    dtype,
                    shape,
                    device: Device::Cuda(3),
                    little_endian: true,
                };
                assert_eq!(TensorMeta::decode(&m.encode()).unwrap(), m);
            }
        }
    }

    #[test]
    fn extension_bytes_after_the_shape_are_ignored() {
        // What the Python client writes for a tensor put from torch: framework byte 2.
        let m = TensorMeta {
            dtype: DType::BF16,
            shape: vec![2, 3],
            device: Device::Cpu,
            little_endian: true,
        };
        let mut b = m.encode();
        b.push(2);
        assert_eq!(TensorMeta::decode(&b).unwrap(), m);
        b.extend_from_slice(&[7, 7]); // fields a later version may add
        assert_eq!(TensorMeta::decode(&b).unwrap(), m);
    }

    #[test]
    fn garbage_headers_are_errors() {
        assert!(TensorMeta::decode(b"").is_err());
        assert!(TensorMeta::decode(b"VTNS\x01\x63\x01\x00\0\0\0\0\0\0\0\0").is_err());
        let mut m = TensorMeta {
            dtype: DType::F32,
            shape: vec![2],
            device: Device::Cpu,
            little_endian: true,
        }
        .encode();
        m.pop();
        assert!(TensorMeta::decode(&m).is_err());
        assert!(TensorView::new(DType::F32, &[2, 3], &[0u8; 23]).is_err());
    }
}
