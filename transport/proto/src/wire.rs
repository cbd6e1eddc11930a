//! The frame header and the field encoding (PROTOCOL.md, "Frames" and "Field types").

use vovp_types::{Device, DeviceBlock, Location, ObjectId, ObjectName, ObjectRef};

use crate::{DecodeError, HEADER_LEN, LENGTH_OVERHEAD, MAX_PAYLOAD, VERSION};

/// A parsed frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub version: u8,
    pub opcode: u8,
    pub flags: u16,
    pub request_id: u64,
    pub payload_len: usize,
}

impl Header {
    /// Parses the header at the start of `buf`; `Ok(None)` when fewer than 16 bytes are there.
    /// A bad length or version is fatal for the connection ([`DecodeError::is_fatal`]).
    pub fn parse(buf: &[u8]) -> Result<Option<Header>, DecodeError> {
        let Some(head) = buf.first_chunk::<HEADER_LEN>() else {
            return Ok(None);
        };
        let length = u32::from_le_bytes([head[0], head[1], head[2], head[3]]);
        if length < LENGTH_OVERHEAD {
            return Err(DecodeError::LengthBelowHeader(length));
        }
        if length as u64 > LENGTH_OVERHEAD as u64 + MAX_PAYLOAD as u64 {
            return Err(DecodeError::FrameTooLarge(length as u64));
        }
        if head[4] != VERSION {
            return Err(DecodeError::UnsupportedVersion(head[4].into()));
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&head[8..16]);
        Ok(Some(Header {
            version: head[4],
            opcode: head[5],
            flags: u16::from_le_bytes([head[6], head[7]]),
            request_id: u64::from_le_bytes(id),
            payload_len: (length - LENGTH_OVERHEAD) as usize,
        }))
    }

    /// Bytes of the whole frame, header included.
    pub fn frame_len(&self) -> usize {
        HEADER_LEN + self.payload_len
    }
}

/// Appends one frame to a buffer; the length is patched in on `finish`.
#[derive(Debug)]
pub struct FrameWriter<'a> {
    buf: &'a mut Vec<u8>,
    start: usize,
}

impl<'a> FrameWriter<'a> {
    pub fn begin(buf: &'a mut Vec<u8>, opcode: u8, flags: u16, request_id: u64) -> Self {
        let start = buf.len();
        buf.extend_from_slice(&[0; 4]);
        buf.push(VERSION);
        buf.push(opcode);
        buf.extend_from_slice(&flags.to_le_bytes());
        buf.extend_from_slice(&request_id.to_le_bytes());
        FrameWriter { buf, start }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A `u32` count or length. One past `u32::MAX` cannot be in memory beside a frame that
    /// fits [`MAX_PAYLOAD`](crate::MAX_PAYLOAD); should it ever be, the count saturates and the
    /// frame is refused as too long, never read with a wrapped count.
    pub fn count(&mut self, n: usize) -> &mut Self {
        self.u32(u32::try_from(n).unwrap_or(u32::MAX))
    }
    pub fn i64(&mut self, v: i64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A `str`: names and messages (cut at 65535 bytes on a char boundary).
    pub fn str(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(u16::try_from(end).unwrap_or(u16::MAX));
        self.buf.extend_from_slice(&s.as_bytes()[..end]);
        self
    }
    /// A `bytes` field (metadata: at most 64 KiB, far below the u32 length).
    pub fn bytes(&mut self, b: &[u8]) -> &mut Self {
        self.count(b.len());
        self.buf.extend_from_slice(b);
        self
    }
    /// Bytes with no length before them (PUT's data, to the end of the frame).
    pub fn raw(&mut self, b: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(b);
        self
    }
    /// DLPack device codes: `u8 device_type, u32 device_id`.
    pub fn device(&mut self, d: Device) -> &mut Self {
        match d {
            Device::Cpu => self.u8(1).u32(0),
            Device::Cuda(n) => self.u8(2).u32(n),
        }
    }
    pub fn location(&mut self, l: &Location) -> &mut Self {
        match l {
            Location::Host { segment, offset } => {
                self.u8(1).u32(*segment).u64(*offset);
            }
            Location::Cuda(b) => {
                self.u8(2).u32(b.device).u32(b.pool).u64(b.offset);
                self.raw(&b.ipc_handle);
            }
        }
        self
    }
    /// An `objref` (the name is not on the wire: the request said it).
    pub fn object(&mut self, r: &ObjectRef) -> &mut Self {
        self.u64(r.id.get())
            .u64(r.size)
            .location(&r.location)
            .bytes(&r.metadata)
            .u64(r.version)
    }
    pub fn finish(self) {
        let len = u32::try_from(self.buf.len() - self.start - 4).unwrap_or(u32::MAX);
        self.buf[self.start..self.start + 4].copy_from_slice(&len.to_le_bytes());
    }
}

/// Reads fields from a payload; every read is bounds-checked.
#[derive(Debug)]
pub struct Reader<'a> {
    b: &'a [u8],
}

impl<'a> Reader<'a> {
    pub fn new(b: &'a [u8]) -> Self {
        Reader { b }
    }
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.b.len() < n {
            return Err(DecodeError::Truncated {
                what,
                need: n,
                have: self.b.len(),
            });
        }
        let (head, rest) = self.b.split_at(n);
        self.b = rest;
        Ok(head)
    }
    /// `N` bytes as they are (an IPC handle, a nonce).
    pub fn array<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    pub fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1, "a u8")?[0])
    }
    pub fn u16(&mut self) -> Result<u16, DecodeError> {
        self.array("a u16").map(u16::from_le_bytes)
    }
    pub fn u32(&mut self) -> Result<u32, DecodeError> {
        self.array("a u32").map(u32::from_le_bytes)
    }
    pub fn u64(&mut self) -> Result<u64, DecodeError> {
        self.array("a u64").map(u64::from_le_bytes)
    }
    pub fn i64(&mut self) -> Result<i64, DecodeError> {
        self.array("an i64").map(i64::from_le_bytes)
    }
    pub fn str(&mut self) -> Result<&'a str, DecodeError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n, "a string")?).map_err(|_| DecodeError::NotUtf8)
    }
    /// An object name: a `str` whose bytes must be UTF-8 (else INVALID_NAME, not MALFORMED).
    /// Its length is the store's to judge (an empty or too long name is a store error).
    pub fn name(&mut self) -> Result<&'a str, DecodeError> {
        let n = self.u16()? as usize;
        std::str::from_utf8(self.take(n, "a name")?)
            .map_err(|_| DecodeError::InvalidName("name is not UTF-8".into()))
    }
    pub fn bytes(&mut self) -> Result<&'a [u8], DecodeError> {
        let n = self.u32()? as usize;
        self.take(n, "a byte string")
    }
    /// Everything left (PUT's data).
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
    /// Bytes not read yet.
    pub fn rest_len(&self) -> usize {
        self.b.len()
    }
    /// A count of items each at least `min_item` bytes: refuses counts the payload cannot hold,
    /// so a forged count cannot make us reserve huge vectors.
    pub fn count(&mut self, min_item: usize) -> Result<usize, DecodeError> {
        let n = self.u32()?;
        if (n as usize).saturating_mul(min_item) > self.b.len() {
            return Err(DecodeError::ForgedCount(n));
        }
        Ok(n as usize)
    }
    pub fn device(&mut self) -> Result<Device, DecodeError> {
        let t = self.u8()?;
        let id = self.u32()?;
        match t {
            1 => Ok(Device::Cpu),
            2 => Ok(Device::Cuda(id)),
            other => Err(DecodeError::DeviceType(other)),
        }
    }
    /// A `loc` of an object of `size` bytes (a CUDA block records its size).
    pub fn location(&mut self, size: u64) -> Result<Location, DecodeError> {
        match self.u8()? {
            1 => Ok(Location::Host {
                segment: self.u32()?,
                offset: self.u64()?,
            }),
            2 => Ok(Location::Cuda(DeviceBlock {
                device: self.u32()?,
                pool: self.u32()?,
                offset: self.u64()?,
                ipc_handle: self.array("an IPC handle")?,
                size,
            })),
            k => Err(DecodeError::LocationKind(k)),
        }
    }
    /// An `objref` answering for `name`.
    pub fn object(&mut self, name: &str) -> Result<ObjectRef, DecodeError> {
        let id = self.u64()?;
        let size = self.u64()?;
        let location = self.location(size)?;
        let metadata = self.bytes()?.into();
        Ok(ObjectRef {
            id: ObjectId::from_raw(id),
            name: object_name(name)?,
            size,
            metadata,
            location,
            version: self.u64()?,
        })
    }
    /// Succeeds only when every byte was read.
    pub fn finish(self) -> Result<(), DecodeError> {
        if self.b.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::Trailing(self.b.len()))
        }
    }
}

pub(crate) fn object_name(name: &str) -> Result<ObjectName, DecodeError> {
    ObjectName::new(name).map_err(|e| DecodeError::InvalidName(e.to_string()))
}
