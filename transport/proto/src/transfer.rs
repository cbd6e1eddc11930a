//! The transfer protocol between engines (PROTOCOL.md, "Transfers between engines"), with no
//! I/O: the ticket a receiving engine mints and the frames of one TCP stream.
//!
//! A stream carries one request: the receiver sends OPEN (its ticket, the ticket's MAC and
//! which of the ticket's streams this is); the holder answers with the object's HEADER (size,
//! version, metadata) or a refusal; the receiver sends ASK (byte ranges, or rows by id); the
//! holder answers GO (the byte count that follows) or a refusal, then the bytes, raw, and
//! closes. Every message but the raw bytes is a `u32` length and that many bytes, so a peer
//! reads it whole before parsing (at most [`MAX_MESSAGE`]).
//!
//! Tickets: the cluster's engines share a 32-byte key; the receiver mints a ticket (name,
//! version, expiry, a random 128-bit nonce, its stream count) and MACs it with the key (BLAKE3
//! in keyed mode, over a context string and the ticket's bytes). The holder serves a stream
//! only for a ticket whose MAC checks, that has not expired, for an object it holds at that
//! version, and whose (nonce, stream) it has not served before: a ticket is good for one
//! transfer of one object, a replay or a copy taken off the wire after use gets nothing.
//! The bytes themselves are neither encrypted nor authenticated: engines talk over a private
//! network (ARCHITECTURE.md, "Security").

use crate::wire::Reader;
use crate::DecodeError;

/// First bytes of OPEN: what this port speaks (and its version).
pub const MAGIC: [u8; 8] = *b"VOVPXFR1";
/// Bytes of the shared key, the nonce and the MAC.
pub const KEY_LEN: usize = 32;
pub const NONCE_LEN: usize = 16;
pub const MAC_LEN: usize = 32;
/// Largest message (OPEN, HEADER, ASK, GO) and most ranges one ASK may name: defined with
/// every other limit, in `vovp-types`.
pub use vovp_types::transfer::{MAX_ASK_RANGES as MAX_RANGES, MAX_MESSAGE};
/// ASK kinds.
const ASK_RANGES: u8 = 1;
const ASK_ROWS: u8 = 2;
/// The MAC's context: a ticket's MAC is no MAC of anything else made with the same key.
#[cfg(feature = "tickets")]
const MAC_CONTEXT: &[u8] = b"vovp transfer ticket v1\0";

/// The cluster's shared secret. Its `Debug` does not show it.
#[derive(Clone, PartialEq, Eq)]
pub struct TransferKey(pub [u8; KEY_LEN]);

impl std::fmt::Debug for TransferKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("TransferKey(..)")
    }
}

impl TransferKey {
    /// A key as a file or a variable holds it: 64 hex digits (surrounding whitespace
    /// ignored) or exactly 32 raw bytes.
    pub fn parse(text: &[u8]) -> Result<TransferKey, String> {
        if text.len() == KEY_LEN {
            let mut k = [0u8; KEY_LEN];
            k.copy_from_slice(text);
            return Ok(TransferKey(k));
        }
        let hex = std::str::from_utf8(text)
            .map_err(|_| "a transfer key is 64 hex digits or 32 bytes".to_string())?
            .trim();
        if hex.len() != 2 * KEY_LEN || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(format!(
                "a transfer key is 64 hex digits or 32 bytes, not {} characters",
                hex.len()
            ));
        }
        let mut k = [0u8; KEY_LEN];
        for (i, byte) in k.iter_mut().enumerate() {
            *byte = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16)
                .map_err(|_| "not hex".to_string())?;
        }
        Ok(TransferKey(k))
    }
}

/// What a receiving engine asks a holder for: one object at one version, until `expires`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    pub name: String,
    pub version: u64,
    /// Unix time in milliseconds after which the holder refuses it.
    pub expires_unix_ms: u64,
    pub nonce: [u8; NONCE_LEN],
    /// Streams the receiver may open with it (numbered from 0), each served once.
    pub streams: u16,
}

impl Ticket {
    fn encode(&self, out: &mut Vec<u8>) {
        put_str(out, &self.name);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(&self.expires_unix_ms.to_le_bytes());
        out.extend_from_slice(&self.nonce);
        out.extend_from_slice(&self.streams.to_le_bytes());
    }

    fn decode(r: &mut Reader<'_>) -> Result<Ticket, DecodeError> {
        Ok(Ticket {
            name: r.name()?.to_owned(),
            version: r.u64()?,
            expires_unix_ms: r.u64()?,
            nonce: r.array("a nonce")?,
            streams: r.u16()?,
        })
    }

    /// The ticket's MAC under `key`.
    #[cfg(feature = "tickets")]
    pub fn mac(&self, key: &TransferKey) -> [u8; MAC_LEN] {
        let mut bytes = MAC_CONTEXT.to_vec();
        self.encode(&mut bytes);
        *blake3::keyed_hash(&key.0, &bytes).as_bytes()
    }

    /// Whether `mac` is this ticket's under `key` (compared in constant time).
    #[cfg(feature = "tickets")]
    pub fn verify(&self, key: &TransferKey, mac: &[u8; MAC_LEN]) -> bool {
        let mut bytes = MAC_CONTEXT.to_vec();
        self.encode(&mut bytes);
        blake3::keyed_hash(&key.0, &bytes) == blake3::Hash::from_bytes(*mac)
    }
}

/// OPEN: the first message of a stream (receiver to holder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Open {
    pub ticket: Ticket,
    pub mac: [u8; MAC_LEN],
    /// Which of the ticket's streams this is (below `ticket.streams`).
    pub stream: u16,
}

impl Open {
    /// The message, its length first.
    pub fn encode(&self) -> Vec<u8> {
        message(|out| {
            out.extend_from_slice(&MAGIC);
            self.ticket.encode(out);
            out.extend_from_slice(&self.mac);
            out.extend_from_slice(&self.stream.to_le_bytes());
        })
    }

    /// An OPEN's bytes after its length.
    pub fn decode(body: &[u8]) -> Result<Open, DecodeError> {
        let mut r = Reader::new(body);
        if r.array::<8>("the magic")? != MAGIC {
            return Err(DecodeError::TransferMagic);
        }
        let open = Open {
            ticket: Ticket::decode(&mut r)?,
            mac: r.array("a MAC")?,
            stream: r.u16()?,
        };
        r.finish()?;
        Ok(open)
    }
}

/// The holder's answer to OPEN, and to ASK ([`Go`]): what it serves, or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Header {
    /// The object the ticket names: `size` bytes of data, its version and metadata.
    Object {
        size: u64,
        version: u64,
        metadata: Vec<u8>,
    },
    Refused(String),
}

impl Header {
    pub fn encode(&self) -> Vec<u8> {
        message(|out| match self {
            Header::Object {
                size,
                version,
                metadata,
            } => {
                out.push(0);
                out.extend_from_slice(&size.to_le_bytes());
                out.extend_from_slice(&version.to_le_bytes());
                put_count(out, metadata.len());
                out.extend_from_slice(metadata);
            }
            Header::Refused(why) => refusal(out, why),
        })
    }

    pub fn decode(body: &[u8]) -> Result<Header, DecodeError> {
        let mut r = Reader::new(body);
        let header = match r.u8()? {
            0 => Header::Object {
                size: r.u64()?,
                version: r.u64()?,
                metadata: r.bytes()?.to_vec(),
            },
            _ => Header::Refused(r.str()?.to_owned()),
        };
        r.finish()?;
        Ok(header)
    }
}

/// ASK: which bytes of the object this stream wants (receiver to holder).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ask {
    /// `(offset, len)` ranges, sent back to back in this order.
    Ranges(Vec<(u64, u64)>),
    /// Rows of `row_bytes` bytes (row `i` at byte `i * row_bytes`), in the order of `ids`.
    Rows { row_bytes: u64, ids: Vec<u64> },
}

impl Ask {
    pub fn encode(&self) -> Vec<u8> {
        message(|out| match self {
            Ask::Ranges(ranges) => {
                out.push(ASK_RANGES);
                put_count(out, ranges.len());
                for (offset, len) in ranges {
                    out.extend_from_slice(&offset.to_le_bytes());
                    out.extend_from_slice(&len.to_le_bytes());
                }
            }
            Ask::Rows { row_bytes, ids } => {
                out.push(ASK_ROWS);
                out.extend_from_slice(&row_bytes.to_le_bytes());
                put_count(out, ids.len());
                for id in ids {
                    out.extend_from_slice(&id.to_le_bytes());
                }
            }
        })
    }

    pub fn decode(body: &[u8]) -> Result<Ask, DecodeError> {
        let mut r = Reader::new(body);
        let ask = match r.u8()? {
            ASK_RANGES => {
                let n = r.count(16)?;
                if n > MAX_RANGES {
                    return Err(DecodeError::TooManyRanges(n));
                }
                Ask::Ranges(
                    (0..n)
                        .map(|_| Ok((r.u64()?, r.u64()?)))
                        .collect::<Result<_, DecodeError>>()?,
                )
            }
            ASK_ROWS => {
                let row_bytes = r.u64()?;
                let n = r.count(8)?;
                Ask::Rows {
                    row_bytes,
                    ids: (0..n).map(|_| r.u64()).collect::<Result<_, _>>()?,
                }
            }
            other => return Err(DecodeError::TransferAsk(other)),
        };
        r.finish()?;
        Ok(ask)
    }

    /// Bytes the answer carries (saturating: a sum past `u64` is refused anyway).
    pub fn bytes(&self) -> u64 {
        match self {
            Ask::Ranges(ranges) => ranges.iter().fold(0u64, |n, r| n.saturating_add(r.1)),
            Ask::Rows { row_bytes, ids } => row_bytes.saturating_mul(ids.len() as u64),
        }
    }
}

/// GO: the holder's answer to ASK: the bytes follow (`total` of them), or why not.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Go {
    Bytes(u64),
    Refused(String),
}

impl Go {
    pub fn encode(&self) -> Vec<u8> {
        message(|out| match self {
            Go::Bytes(total) => {
                out.push(0);
                out.extend_from_slice(&total.to_le_bytes());
            }
            Go::Refused(why) => refusal(out, why),
        })
    }

    pub fn decode(body: &[u8]) -> Result<Go, DecodeError> {
        let mut r = Reader::new(body);
        let go = match r.u8()? {
            0 => Go::Bytes(r.u64()?),
            _ => Go::Refused(r.str()?.to_owned()),
        };
        r.finish()?;
        Ok(go)
    }
}

/// The length of a message from its first 4 bytes, if it is within [`MAX_MESSAGE`].
pub fn message_len(prefix: [u8; 4]) -> Result<usize, DecodeError> {
    let n = u32::from_le_bytes(prefix) as usize;
    if n > MAX_MESSAGE {
        return Err(DecodeError::FrameTooLarge(n as u64));
    }
    Ok(n)
}

/// A message: `u32` length, then what `body` writes.
fn message(body: impl FnOnce(&mut Vec<u8>)) -> Vec<u8> {
    let mut out = vec![0u8; 4];
    body(&mut out);
    let len = u32::try_from(out.len() - 4).unwrap_or(u32::MAX);
    out[..4].copy_from_slice(&len.to_le_bytes());
    out
}

/// A `u32` count. (Counts past `u32` cannot be in a message of at most [`MAX_MESSAGE`]
/// bytes: such a message is refused by its reader whatever this writes.)
fn put_count(out: &mut Vec<u8>, n: usize) {
    out.extend_from_slice(&u32::try_from(n).unwrap_or(u32::MAX).to_le_bytes());
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    // Names are at most 256 bytes and refusals are cut to fit: the length always fits.
    let len = u16::try_from(s.len()).unwrap_or(u16::MAX);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&s.as_bytes()[..usize::from(len)]);
}

/// A refusal: status 1 and the reason (cut at a character boundary to fit a `str`).
fn refusal(out: &mut Vec<u8>, why: &str) {
    let mut end = why.len().min(usize::from(u16::MAX));
    while !why.is_char_boundary(end) {
        end -= 1;
    }
    out.push(1);
    put_str(out, &why[..end]);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ticket() -> Ticket {
        Ticket {
            name: "weights".into(),
            version: 7,
            expires_unix_ms: 1_700_000_000_000,
            nonce: [9; NONCE_LEN],
            streams: 4,
        }
    }

    fn body(message: &[u8]) -> &[u8] {
        let n = message_len(message[..4].try_into().unwrap()).unwrap();
        assert_eq!(n, message.len() - 4);
        &message[4..]
    }

    #[test]
    fn messages_round_trip() {
        let open = Open {
            ticket: ticket(),
            mac: [3; MAC_LEN],
            stream: 2,
        };
        assert_eq!(Open::decode(body(&open.encode())).unwrap(), open);
        for h in [
            Header::Object {
                size: 1 << 30,
                version: 7,
                metadata: b"VTNS".to_vec(),
            },
            Header::Refused("expired".into()),
        ] {
            assert_eq!(Header::decode(body(&h.encode())).unwrap(), h);
        }
        for a in [
            Ask::Ranges(vec![(0, 64), (4096, 1 << 20)]),
            Ask::Rows {
                row_bytes: 512,
                ids: vec![3, 1, 3],
            },
        ] {
            assert_eq!(Ask::decode(body(&a.encode())).unwrap(), a);
        }
        assert_eq!(
            Ask::Rows {
                row_bytes: 8,
                ids: vec![1, 2]
            }
            .bytes(),
            16
        );
        for g in [Go::Bytes(12), Go::Refused("row 9 is past the end".into())] {
            assert_eq!(Go::decode(body(&g.encode())).unwrap(), g);
        }
        // Not this protocol: refused before anything else is read.
        let mut other = open.encode();
        other[4] = b'X';
        assert_eq!(Open::decode(body(&other)), Err(DecodeError::TransferMagic));
        assert!(message_len(((MAX_MESSAGE + 1) as u32).to_le_bytes()).is_err());
    }

    #[test]
    fn keys_parse_from_hex_or_raw_bytes() {
        let hex = "00ff".repeat(16);
        let k = TransferKey::parse(format!(" {hex}\n").as_bytes()).unwrap();
        assert_eq!((k.0[0], k.0[1], k.0[31]), (0, 255, 255));
        assert_eq!(TransferKey::parse(&[7u8; 32]).unwrap().0, [7; 32]);
        assert!(TransferKey::parse(b"abc").is_err());
        assert!(TransferKey::parse("zz".repeat(32).as_bytes()).is_err());
        assert_eq!(format!("{k:?}"), "TransferKey(..)");
    }

    #[cfg(feature = "tickets")]
    #[test]
    fn a_mac_checks_only_for_its_ticket_and_key() {
        let key = TransferKey([1; KEY_LEN]);
        let t = ticket();
        let mac = t.mac(&key);
        assert!(t.verify(&key, &mac));
        assert!(!t.verify(&TransferKey([2; KEY_LEN]), &mac));
        for changed in [
            Ticket {
                version: 8,
                ..t.clone()
            },
            Ticket {
                streams: 5,
                ..t.clone()
            },
            Ticket {
                expires_unix_ms: t.expires_unix_ms + 1,
                ..t.clone()
            },
            Ticket {
                name: "weightz".into(),
                ..t.clone()
            },
            Ticket {
                nonce: [8; NONCE_LEN],
                ..t.clone()
            },
        ] {
            assert!(!changed.verify(&key, &mac), "{changed:?}");
        }
    }
}
