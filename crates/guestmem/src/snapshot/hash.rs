//! Block checksums.
//!
//! Written here because no crate on guestmem's dependency list (the crates of this field)
//! offers a checksum, and a snapshot's checksum runs over every byte saved and restored, so it
//! must keep up with memory copies. It is a corruption check (bit rot, a torn or foreign
//! file), not a defence against someone forging images: not cryptographic.
//!
//! Eight independent lanes each take one little-endian `u64` of every 64-byte stripe:
//! `lane = rotl((lane ^ word) * P, 29)`. For a given rest of the input each step is a
//! bijection of the lane's state (xor, multiplication by an odd constant, rotation), so
//! changing any one word (a flipped bit, a changed byte) always changes the final state of
//! its lane: a single corrupted word is always detected. The lanes, the length and a final
//! avalanche are folded into 64 bits. Eight lanes keep eight multiplications in flight.

const P: u64 = 0x9E37_79B9_7F4A_7C15;
const SEEDS: [u64; 8] = [
    0x243F_6A88_85A3_08D3,
    0x1319_8A2E_0370_7344,
    0xA409_3822_299F_31D0,
    0x082E_FA98_EC4E_6C89,
    0x4528_21E6_38D0_1377,
    0xBE54_66CF_34E9_0C6C,
    0xC0AC_29B7_C97C_50DD,
    0x3F84_D5B5_B547_0917,
];

/// Bytes one stripe takes; inputs are whole stripes (guestmem hashes whole pages).
pub(crate) const STRIPE: usize = 64;

/// A streaming block hash over whole 64-byte stripes.
#[derive(Debug, Clone)]
pub(crate) struct BlockHasher {
    lanes: [u64; 8],
    len: u64,
}

impl Default for BlockHasher {
    fn default() -> Self {
        BlockHasher {
            lanes: SEEDS,
            len: 0,
        }
    }
}

#[inline(always)]
fn step(lane: u64, word: u64) -> u64 {
    (lane ^ word).wrapping_mul(P).rotate_left(29)
}

impl BlockHasher {
    /// Adds `data`, a whole number of stripes. Returns whether any byte was non-zero.
    pub(crate) fn update(&mut self, data: &[u8]) -> bool {
        debug_assert_eq!(data.len() % STRIPE, 0);
        let mut any = 0u64;
        let mut l = self.lanes;
        for s in data.chunks_exact(STRIPE) {
            for (i, lane) in l.iter_mut().enumerate() {
                let w = u64::from_le_bytes(s[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                any |= w;
                *lane = step(*lane, w);
            }
        }
        self.lanes = l;
        self.len += data.len() as u64;
        any != 0
    }

    /// Adds `len` zero bytes (a whole number of stripes) without reading memory.
    pub(crate) fn update_zeros(&mut self, len: usize) {
        debug_assert_eq!(len % STRIPE, 0);
        let mut l = self.lanes;
        for _ in 0..len / STRIPE {
            for lane in l.iter_mut() {
                *lane = step(*lane, 0);
            }
        }
        self.lanes = l;
        self.len += len as u64;
    }

    /// Adds `len` bytes (a whole number of stripes) read with volatile loads from `ptr`:
    /// guest memory, which another thread (a vCPU) may write meanwhile. Returns whether any
    /// byte was non-zero.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be mapped readable for the whole call and 8-byte aligned.
    pub(crate) unsafe fn update_volatile(&mut self, ptr: *const u8, len: usize) -> bool {
        debug_assert_eq!(len % STRIPE, 0);
        debug_assert_eq!(ptr as usize % 8, 0);
        let words = ptr as *const u64;
        let mut any = 0u64;
        let mut l = self.lanes;
        for s in 0..len / STRIPE {
            for (i, lane) in l.iter_mut().enumerate() {
                // SAFETY: s * 8 + i < len / 8 words from an aligned, mapped pointer (the
                // caller's contract); volatile because the guest may write it concurrently.
                let w = u64::from_le(unsafe { std::ptr::read_volatile(words.add(s * 8 + i)) });
                any |= w;
                *lane = step(*lane, w);
            }
        }
        self.lanes = l;
        self.len += len as u64;
        any != 0
    }

    /// The checksum.
    pub(crate) fn finish(&self) -> u64 {
        let mut h = self.len.wrapping_mul(P);
        for (i, lane) in self.lanes.iter().enumerate() {
            h = (h ^ lane.rotate_left(i as u32 * 8)).wrapping_mul(P);
            h ^= h >> 31;
        }
        h ^= h >> 33;
        h = h.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
        h ^= h >> 33;
        h
    }
}

/// The checksum of `data` (whole stripes).
#[cfg(test)]
pub(crate) fn checksum(data: &[u8]) -> u64 {
    let mut h = BlockHasher::default();
    h.update(data);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_single_byte_change_is_detected() {
        let mut data = vec![0u8; 4096];
        for (i, b) in data.iter_mut().enumerate() {
            *b = (i * 7) as u8;
        }
        let base = checksum(&data);
        for i in 0..data.len() {
            for bit in [0x01u8, 0x80, 0xff] {
                data[i] ^= bit;
                assert_ne!(checksum(&data), base, "byte {i} ^ {bit:#x}");
                data[i] ^= bit;
            }
        }
    }

    #[test]
    fn zeros_streamed_and_read_agree_and_length_counts() {
        let mut a = BlockHasher::default();
        a.update_zeros(8192);
        assert_eq!(a.finish(), checksum(&[0u8; 8192]));
        assert_ne!(checksum(&[0u8; 4096]), checksum(&[0u8; 8192]));
        let data: Vec<u8> = (0..8192u32).map(|i| (i % 251) as u8).collect();
        let mut b = BlockHasher::default();
        b.update(&data[..4096]);
        b.update(&data[4096..]);
        assert_eq!(b.finish(), checksum(&data));
        let mut c = BlockHasher::default();
        // Vec<u8> is only byte-aligned: hash a u64 copy.
        let words: Vec<u64> = data
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap()))
            .collect();
        // SAFETY: `words` is live, aligned and 8192 bytes long for the call.
        let any = unsafe { c.update_volatile(words.as_ptr() as *const u8, 8192) };
        assert!(any);
        assert_eq!(c.finish(), checksum(&data));
    }
}
