//! A frame as stored: a 12-byte header (`GMFR`, version, encoding, the plain length) and its
//! bytes, raw or zstd-compressed, stored under the BLAKE3 hash of its plain bytes. Nothing read
//! back is used before its header, length and hash are checked. A piece of a move's diff
//! named later (`store::later`) is served by the move's source with the hash of its plain
//! bytes in front ([`NAMED_PREFIX_BYTES`]), checked as any frame against that hash.

use bytes::{Buf, Bytes};

/// A map keyed by frame hashes.
pub(crate) type ByHash<V> = std::collections::HashMap<[u8; 32], V, HashKeyed>;

/// Hashes a frame's BLAKE3 hash for a map: each of its four words in turn, folded with two
/// keys drawn at random once per map, so that names chosen to share bits (a cache file or
/// a manifest made to slow a server's maps: the hashes in a cache's headers are bytes on a
/// disk, not hashes of anything yet) do not share buckets. SipHash of 32-byte keys was 3.6%
/// of a warm pass's prefetch thread. (Until 2026-11-29 only the first word was folded: names
/// alike in it fell in one probe chain.)
#[derive(Debug, Clone, Copy)]
pub(crate) struct HashKeyed(u64, u64);

impl Default for HashKeyed {
    fn default() -> Self {
        use std::hash::BuildHasher;
        let r = std::collections::hash_map::RandomState::new();
        HashKeyed(r.hash_one(1u8), r.hash_one(2u8) | 1)
    }
}

impl std::hash::BuildHasher for HashKeyed {
    type Hasher = KeyedHasher;
    fn build_hasher(&self) -> KeyedHasher {
        KeyedHasher {
            keys: (self.0, self.1),
            h: 0,
        }
    }
}

/// See [`HashKeyed`].
#[derive(Debug)]
pub(crate) struct KeyedHasher {
    keys: (u64, u64),
    h: u64,
}

impl std::hash::Hasher for KeyedHasher {
    fn write(&mut self, bytes: &[u8]) {
        // Every word of the hash: names read from a cache's files or a store are outside
        // input, and names alike in their first word must not all land in one slot.
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            let x = (u64::from_le_bytes(w) ^ self.h ^ self.keys.0) as u128 * self.keys.1 as u128;
            self.h = (x as u64) ^ ((x >> 64) as u64);
        }
    }
    fn write_usize(&mut self, _: usize) {
        // The length a slice's hash writes first: the same for every frame hash.
    }
    fn finish(&self) -> u64 {
        self.h
    }
}

/// The header's magic.
const MAGIC: [u8; 4] = *b"GMFR";
/// The header's version.
const VERSION: u8 = 1;
/// Header bytes.
pub(crate) const HEADER_BYTES: usize = 12;
/// zstd's level for frames: fast to write (hundreds of MB/s a thread), decoded at over 1 GB/s.
const ZSTD_LEVEL: i32 = 1;
/// A frame is kept compressed only when that saves at least an eighth: below that, the
/// decode on every fault costs more than the bytes it saves.
const PAYS_NUMERATOR: usize = 7;

/// How a frame's bytes are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Encoding {
    Raw = 0,
    Zstd = 1,
}

/// A frame's header, for `plain_len` plain bytes kept as `enc`.
fn header(out: &mut Vec<u8>, plain_len: usize, enc: Encoding) {
    out.extend_from_slice(&MAGIC);
    out.push(VERSION);
    out.push(enc as u8);
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&(plain_len as u32).to_le_bytes());
}

/// An empty raw object for `plain_len` plain bytes, its header written: the caller appends
/// exactly those bytes (read straight into place, no copy after).
pub(crate) fn raw_for(plain_len: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + plain_len);
    header(&mut out, plain_len, Encoding::Raw);
    out
}

/// The object of `plain`, kept raw.
pub(crate) fn raw(plain: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_BYTES + plain.len());
    header(&mut out, plain.len(), Encoding::Raw);
    out.extend_from_slice(plain);
    out
}

/// The object of `plain`, compressed where that pays.
pub(crate) fn encode(plain: &[u8]) -> (Vec<u8>, Encoding) {
    let mut out = Vec::with_capacity(HEADER_BYTES + plain.len());
    header(&mut out, plain.len(), Encoding::Raw);
    let enc = match zstd::bulk::compress(plain, ZSTD_LEVEL) {
        Ok(z) if z.len() * 8 <= plain.len() * PAYS_NUMERATOR => {
            out.extend_from_slice(&z);
            Encoding::Zstd
        }
        _ => {
            out.extend_from_slice(plain);
            Encoding::Raw
        }
    };
    out[5] = enc as u8;
    (out, enc)
}

/// The plain bytes of `object`, checked: its header, its length (`want` bytes) and its hash.
/// A raw frame's bytes are moved to the front of the object's own buffer when it holds them
/// alone (a GET's body, gathered into one buffer): no new buffer, whose fresh pages cost a
/// fault each, and no second copy from one to the other.
pub(crate) fn decode(
    mut object: Bytes,
    want: usize,
    hash: &blake3::Hash,
) -> Result<Vec<u8>, String> {
    if object.len() < HEADER_BYTES || object[..4] != MAGIC {
        return Err(format!(
            "{} bytes that do not start with a frame header",
            object.len()
        ));
    }
    if object[4] != VERSION {
        return Err(format!(
            "frame version {}, this guestmem reads {VERSION}",
            object[4]
        ));
    }
    let len = u32::from_le_bytes(object[8..12].try_into().expect("4 bytes")) as usize;
    if len != want {
        return Err(format!("{len} plain bytes, the manifest says {want}"));
    }
    let payload = &object[HEADER_BYTES..];
    let plain = match object[5] {
        0 if payload.len() == len => {
            object.advance(HEADER_BYTES);
            Vec::from(object)
        }
        0 => {
            return Err(format!(
                "raw frame of {} bytes, its header says {len}",
                payload.len()
            ))
        }
        // The capacity bounds what a hostile object can make us allocate.
        1 => zstd::bulk::decompress(payload, len).map_err(|e| format!("zstd: {e}"))?,
        e => return Err(format!("unknown encoding {e}")),
    };
    if plain.len() != len {
        return Err(format!(
            "decodes to {} bytes, its header says {len}",
            plain.len()
        ));
    }
    let found = blake3::hash(&plain);
    if &found != hash {
        return Err(format!(
            "its bytes hash to {}, not to its name",
            found.to_hex()
        ));
    }
    Ok(plain)
}

/// Bytes before a placeholder's object as the source serves it: the BLAKE3 hash of the
/// piece's plain bytes.
pub(crate) const NAMED_PREFIX_BYTES: usize = 32;

/// Bytes a move with a key adds after that hash: its seal ([`seal`]).
const SEAL_BYTES: usize = 32;

/// Bytes before a placeholder's object: its hash, and its seal if `sealed`.
pub(crate) fn named_prefix(sealed: bool) -> usize {
    NAMED_PREFIX_BYTES + if sealed { SEAL_BYTES } else { 0 }
}

/// The seal of a piece named later, served for `placeholder` as `hash`, under a move's
/// `key` (from the move key both hosts hold): a keyed BLAKE3 of the two, so that no one
/// without the key can serve other bytes for a placeholder, or one piece for another.
pub(crate) fn seal(key: &[u8; 32], placeholder: &blake3::Hash, hash: &blake3::Hash) -> [u8; 32] {
    let mut h = blake3::Hasher::new_keyed(key);
    h.update(b"piece");
    h.update(placeholder.as_bytes());
    h.update(hash.as_bytes());
    *h.finalize().as_bytes()
}

/// Whether `a` and `b` are equal, in a time that does not depend on where they differ (a
/// token or a MAC compared with what a request or a message carried).
pub(crate) fn same_bytes(a: &[u8], b: &[u8]) -> bool {
    // Their hashes, compared as BLAKE3 compares hashes (`constant_time_eq`): a fold written
    // here could be turned into an early exit by the optimiser.
    a.len() == b.len() && blake3::hash(a) == blake3::hash(b)
}

/// The object of a piece named later as the source serves it: the hash of its plain bytes,
/// with a move key its seal, then its object. Its plain bytes and their hash, once all
/// are checked (the seal, the object's header and length, its bytes against the hash).
/// `sealed`: the move's key and the placeholder the piece was asked for.
pub(crate) fn decode_named(
    mut obj: Bytes,
    len: usize,
    sealed: Option<(&[u8; 32], &blake3::Hash)>,
) -> Result<(Vec<u8>, blake3::Hash), String> {
    let prefix = named_prefix(sealed.is_some());
    if obj.len() < prefix {
        return Err(format!(
            "{} bytes: shorter than the {prefix} a piece named later starts with",
            obj.len()
        ));
    }
    let mut h = [0u8; 32];
    h.copy_from_slice(&obj[..NAMED_PREFIX_BYTES]);
    let hash = blake3::Hash::from_bytes(h);
    if let Some((key, placeholder)) = sealed {
        let want = seal(key, placeholder, &hash);
        if !same_bytes(&want, &obj[NAMED_PREFIX_BYTES..prefix]) {
            return Err(
                "its seal is not this move's: served by a host without the move key, or changed on the way".into(),
            );
        }
    }
    obj.advance(prefix);
    let plain = decode(obj, len, &hash)?;
    Ok((plain, hash))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b(x: &[u8]) -> Bytes {
        Bytes::copy_from_slice(x)
    }

    /// Names alike in any three of their four words still hash apart: a cache file or a
    /// manifest cannot line its names up in one probe chain. (Until 2026-11-29 only the
    /// first word was hashed: 1,000 names sharing it shared one hash.)
    #[test]
    fn names_alike_but_for_one_word_hash_apart() {
        use std::hash::BuildHasher;
        let keyed = HashKeyed::default();
        for word in 0..4 {
            let mut seen = std::collections::HashSet::new();
            for i in 0..1000u64 {
                let mut name = [0xabu8; 32];
                name[word * 8..word * 8 + 8].copy_from_slice(&i.to_le_bytes());
                seen.insert(keyed.hash_one(name));
            }
            assert_eq!(seen.len(), 1000, "names differing in word {word}");
        }
    }

    #[test]
    fn a_raw_frame_is_decoded_in_its_own_buffer() {
        let plain: Vec<u8> = (0..256u32 << 10)
            .map(|i| (i * 7 + i / 4096) as u8)
            .collect();
        let obj = raw(&plain);
        let at = obj.as_ptr();
        let got = decode(Bytes::from(obj), plain.len(), &blake3::hash(&plain)).unwrap();
        assert_eq!(got, plain);
        assert_eq!(got.as_ptr(), at, "copied to a new buffer");
        // Shared with another holder, it is copied: the other still reads the object.
        let obj = Bytes::from(raw(&plain));
        let other = obj.clone();
        let got = decode(obj, plain.len(), &blake3::hash(&plain)).unwrap();
        assert_eq!(got, plain);
        assert_eq!(&other[HEADER_BYTES..], &plain[..]);
    }

    #[test]
    fn frames_round_trip_and_every_corruption_is_caught() {
        let text: Vec<u8> = (0..65536u32).map(|i| (i % 7) as u8).collect();
        let mut x = 0x1234_5678_9abc_def1u64;
        let noise: Vec<u8> = (0..65536)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 32) as u8
            })
            .collect();
        for (plain, enc) in [(&text, Encoding::Zstd), (&noise, Encoding::Raw)] {
            let h = blake3::hash(plain);
            let (obj, e) = encode(plain);
            assert_eq!(e, enc);
            assert_eq!(&decode(b(&obj), plain.len(), &h).unwrap(), plain);
            assert!(decode(b(&obj), plain.len() - 1, &h).is_err());
            assert!(decode(b(&obj[..obj.len() - 1]), plain.len(), &h).is_err());
            let mut bad = obj.clone();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert!(decode(b(&bad), plain.len(), &h).is_err());
            assert!(decode(b(&obj), plain.len(), &blake3::hash(b"other")).is_err());
        }
    }

    #[test]
    fn a_sealed_piece_is_taken_only_with_the_moves_key_and_its_placeholder() {
        let plain = vec![5u8; 8192];
        let hash = blake3::hash(&plain);
        let obj = encode_raw_for_test(&plain);
        let (key, placeholder) = ([9u8; 32], blake3::hash(b"placeholder"));
        let sealed = |k: &[u8; 32], p: &blake3::Hash| {
            let mut o = hash.as_bytes().to_vec();
            o.extend_from_slice(&seal(k, p, &hash));
            o.extend_from_slice(&obj);
            o
        };
        let good = sealed(&key, &placeholder);
        let (got, h) = decode_named(b(&good), plain.len(), Some((&key, &placeholder))).unwrap();
        assert_eq!((got, h), (plain.clone(), hash));
        // Another key, another placeholder, no seal at all: refused.
        for (o, why) in [
            (sealed(&[8u8; 32], &placeholder), "key"),
            (sealed(&key, &blake3::hash(b"another")), "placeholder"),
        ] {
            let e = decode_named(b(&o), plain.len(), Some((&key, &placeholder))).unwrap_err();
            assert!(e.contains("seal"), "{why}: {e}");
        }
        let mut unsealed = hash.as_bytes().to_vec();
        unsealed.extend_from_slice(&obj);
        assert!(decode_named(b(&unsealed), plain.len(), Some((&key, &placeholder))).is_err());
        // Without a key the seal is not looked for.
        assert!(decode_named(b(&unsealed), plain.len(), None).is_ok());
    }

    /// A raw frame object of `plain`, as a push stores one uncompressed.
    fn encode_raw_for_test(plain: &[u8]) -> Vec<u8> {
        let mut o = raw_for(plain.len());
        o.extend_from_slice(plain);
        o
    }
}
