//! Word-level atomic dirty bitmaps: one bit per page of a region.
//!
//! rust-vmm's `AtomicBitmap` sets a range one bit at a time, each with a sequentially
//! consistent `fetch_or`: 512 locked read-modify-writes to mark a 2 MiB range. A
//! [`DirtyBitmap`] builds the mask of every 64-page word the range touches and sets it with
//! one `fetch_or` per word, so the same range costs 8. KVM's dirty log arrives as words too
//! and is merged word by word ([`DirtyBitmap::merge_words`]), skipping clean ones.
//!
//! Readers take a consistent-per-word copy with [`DirtyBitmap::take`] (each word swapped with
//! zero, so a page marked during the harvest lands in this copy or the next, never neither)
//! and walk it with [`DirtyPages`], which skips clean words with one compare and finds set
//! bits with `trailing_zeros`.

use std::sync::atomic::{AtomicU64, Ordering};

/// The page size of every region's dirty bitmap and of KVM's dirty log on x86: one bit per
/// 4 KiB, whatever backs the memory, so the two merge word for word.
pub const DIRTY_PAGE_BYTES: u64 = 4096;

/// Bits in one bitmap word.
const WORD_BITS: u64 = 64;

/// Why a bitmap operation was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DirtyError {
    /// The byte range does not lie inside the bitmap's region.
    #[error("dirty range {offset:#x} + {len:#x} lies outside the {size:#x}-byte region")]
    OutOfRange {
        /// Offset of the range from the region's start.
        offset: u64,
        /// Its length.
        len: u64,
        /// The region's size.
        size: u64,
    },
    /// The bitmap would not fit in memory.
    #[error(
        "a dirty bitmap for {size:#x} bytes of {page_size:#x}-byte pages does not fit in memory"
    )]
    TooLarge {
        /// Bytes asked for.
        size: u64,
        /// The page size.
        page_size: u64,
    },
    /// The page size is not a power of two.
    #[error("page size {page_size:#x} is not a power of two")]
    BadPageSize {
        /// The page size asked for.
        page_size: u64,
    },
    /// A word slice to merge runs past the end of the bitmap.
    #[error("merging {len} words at word {first} runs past the bitmap's {words} words")]
    MergeOutOfRange {
        /// First word to merge.
        first: usize,
        /// Words to merge.
        len: usize,
        /// Words in the bitmap.
        words: usize,
    },
}

/// A dirty bitmap for one region of `size` bytes: bit `i` stands for page `i`.
#[derive(Debug)]
pub struct DirtyBitmap {
    words: Box<[AtomicU64]>,
    size: u64,
    pages: u64,
    page_shift: u32,
}

impl DirtyBitmap {
    /// A clean bitmap for `size` bytes of `page_size`-byte pages (a power of two).
    pub fn new(size: u64, page_size: u64) -> Result<DirtyBitmap, DirtyError> {
        if !page_size.is_power_of_two() {
            return Err(DirtyError::BadPageSize { page_size });
        }
        let page_shift = page_size.trailing_zeros();
        let pages = size.div_ceil(page_size);
        let too_large = DirtyError::TooLarge { size, page_size };
        let n = usize::try_from(pages.div_ceil(WORD_BITS)).map_err(|_| too_large.clone())?;
        let mut words: Vec<AtomicU64> = Vec::new();
        words.try_reserve_exact(n).map_err(|_| too_large)?;
        words.extend((0..n).map(|_| AtomicU64::new(0)));
        Ok(DirtyBitmap {
            words: words.into_boxed_slice(),
            size,
            pages,
            page_shift,
        })
    }

    /// Pages the bitmap covers.
    #[inline]
    pub fn pages(&self) -> u64 {
        self.pages
    }

    /// Bytes the bitmap covers.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The page size in bytes.
    #[inline]
    pub fn page_size(&self) -> u64 {
        1 << self.page_shift
    }

    /// Words in the bitmap (64 pages each).
    pub fn word_count(&self) -> usize {
        self.words.len()
    }

    /// Marks every page that `offset..offset+len` touches as dirty. A zero-length range
    /// marks nothing. One `fetch_or` per 64-page word.
    #[inline]
    pub fn mark(&self, offset: u64, len: u64) -> Result<(), DirtyError> {
        let end =
            offset
                .checked_add(len)
                .filter(|&e| e <= self.size)
                .ok_or(DirtyError::OutOfRange {
                    offset,
                    len,
                    size: self.size,
                })?;
        if len == 0 {
            return Ok(());
        }
        let first = offset >> self.page_shift;
        let last = (end - 1) >> self.page_shift;
        self.mark_pages(first, last);
        Ok(())
    }

    /// Marks pages `first..=last`, which the caller checked lie in the bitmap.
    #[inline]
    fn mark_pages(&self, first: u64, last: u64) {
        let (fw, lw) = ((first / WORD_BITS) as usize, (last / WORD_BITS) as usize);
        let head = !0u64 << (first % WORD_BITS);
        let tail = !0u64 >> (WORD_BITS - 1 - last % WORD_BITS);
        if fw == lw {
            self.words[fw].fetch_or(head & tail, Ordering::Release);
            return;
        }
        self.words[fw].fetch_or(head, Ordering::Release);
        for w in &self.words[fw + 1..lw] {
            w.fetch_or(!0, Ordering::Release);
        }
        self.words[lw].fetch_or(tail, Ordering::Release);
    }

    /// Whether page `page` is dirty (false past the end).
    #[inline]
    pub fn is_dirty(&self, page: u64) -> bool {
        if page >= self.pages {
            return false;
        }
        let w = self.words[(page / WORD_BITS) as usize].load(Ordering::Acquire);
        w & (1 << (page % WORD_BITS)) != 0
    }

    /// ORs `src` (KVM's dirty log layout: bit `i` of word `j` is page `64 j + i`) into the
    /// bitmap starting at word `first`. Clean words cost one compare.
    pub fn merge_words(&self, first: usize, src: &[u64]) -> Result<(), DirtyError> {
        let dst = first
            .checked_add(src.len())
            .and_then(|end| self.words.get(first..end))
            .ok_or(DirtyError::MergeOutOfRange {
                first,
                len: src.len(),
                words: self.words.len(),
            })?;
        for (d, &s) in dst.iter().zip(src) {
            if s != 0 {
                d.fetch_or(s, Ordering::Release);
            }
        }
        Ok(())
    }

    /// Dirty pages now set (a racy count while others mark).
    pub fn count(&self) -> u64 {
        self.words
            .iter()
            .map(|w| u64::from(w.load(Ordering::Acquire).count_ones()))
            .sum()
    }

    /// Moves the dirty bits into `out` (resized to [`DirtyBitmap::word_count`]) and clears
    /// them. Each word is swapped atomically, so a concurrent mark is never lost.
    pub fn take(&self, out: &mut Vec<u64>) {
        out.clear();
        out.extend(self.words.iter().map(|w| {
            // A clean word is only loaded: no locked write to a line nobody dirtied.
            if w.load(Ordering::Relaxed) == 0 {
                0
            } else {
                w.swap(0, Ordering::AcqRel)
            }
        }));
    }

    /// Clears every bit.
    pub fn clear(&self) {
        for w in self.words.iter() {
            w.store(0, Ordering::Release);
        }
    }

    /// A copy of the bits, left set.
    pub fn snapshot(&self) -> Vec<u64> {
        self.words
            .iter()
            .map(|w| w.load(Ordering::Acquire))
            .collect()
    }
}

/// The set pages of a word slice in ascending order, skipping clean words fast.
#[derive(Debug, Clone)]
pub struct DirtyPages<'a> {
    words: &'a [u64],
    index: usize,
    current: u64,
}

impl<'a> DirtyPages<'a> {
    /// Iterates the set bits of `words` (bit `i` of word `j` is page `64 j + i`).
    pub fn new(words: &'a [u64]) -> DirtyPages<'a> {
        DirtyPages {
            words,
            index: 0,
            current: words.first().copied().unwrap_or(0),
        }
    }
}

impl Iterator for DirtyPages<'_> {
    type Item = u64;

    #[inline]
    fn next(&mut self) -> Option<u64> {
        while self.current == 0 {
            self.index += 1;
            self.current = *self.words.get(self.index)?;
        }
        let bit = self.current.trailing_zeros();
        // Clear the lowest set bit.
        self.current &= self.current - 1;
        Some(self.index as u64 * WORD_BITS + u64::from(bit))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn new_too_large_is_refused_not_aborted() {
        assert!(matches!(
            DirtyBitmap::new(u64::MAX, 1),
            Err(DirtyError::TooLarge { .. })
        ));
    }
    use proptest::prelude::*;

    #[test]
    fn mark_zero_len_marks_nothing() {
        let b = DirtyBitmap::new(1 << 20, 4096).unwrap();
        b.mark(4096, 0).unwrap();
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn mark_past_end_is_refused() {
        let b = DirtyBitmap::new(0x10000, 4096).unwrap();
        let e = b.mark(0xf000, 0x1001).unwrap_err();
        assert!(matches!(e, DirtyError::OutOfRange { size: 0x10000, .. }));
        assert!(b.mark(u64::MAX, 2).is_err());
    }

    #[test]
    fn merge_past_end_is_refused() {
        let b = DirtyBitmap::new(64 * 4096, 4096).unwrap();
        assert!(b.merge_words(1, &[1]).is_err());
        b.merge_words(0, &[0b101]).unwrap();
        assert_eq!(DirtyPages::new(&b.snapshot()).collect::<Vec<_>>(), [0, 2]);
    }

    #[test]
    fn take_clears_and_returns_bits() {
        let b = DirtyBitmap::new(256 * 4096, 4096).unwrap();
        b.mark(63 * 4096 + 5, 4096).unwrap();
        let mut out = Vec::new();
        b.take(&mut out);
        assert_eq!(DirtyPages::new(&out).collect::<Vec<_>>(), [63, 64]);
        assert_eq!(b.count(), 0);
    }

    #[test]
    fn dirty_pages_of_empty_slice_is_empty() {
        assert_eq!(DirtyPages::new(&[]).next(), None);
        assert_eq!(DirtyPages::new(&[0, 0]).next(), None);
        let all: Vec<u64> = DirtyPages::new(&[0, 1 << 63]).collect();
        assert_eq!(all, [127]);
    }

    proptest! {
        #[test]
        fn mark_sets_exactly_the_touched_pages(
            pages in 1u64..600,
            a in 0u64..600 * 4096,
            len in 0u64..300 * 4096,
        ) {
            let size = pages * 4096;
            let b = DirtyBitmap::new(size, 4096).unwrap();
            let ok = b.mark(a, len).is_ok();
            prop_assert_eq!(ok, a + len <= size);
            let want: Vec<u64> = if ok && len > 0 {
                (a / 4096..=(a + len - 1) / 4096).collect()
            } else {
                Vec::new()
            };
            let got: Vec<u64> = DirtyPages::new(&b.snapshot()).collect();
            prop_assert_eq!(got, want);
        }
    }
}
