//! Guest address -> host memory, per thread, with a cache of the last region used.
//!
//! Seed 004: a vCPU touches one memslot over and over, so KVM keeps each vCPU's last-used
//! slot and checks it before binary-searching (2.8 s -> 0.3 s per dirty pass with 64 slots).
//! A [`Translator`] is that cache for a userspace thread. It pins one [`MapView`], so every
//! slice it hands out stays mapped while the translator lives; [`Translator::refresh`] moves
//! it to the newest view at a point where the thread holds no slice (a vCPU exit, a
//! device worker's next request), much as KVM's vCPUs pick up new memslots between SRCU
//! read sections.
//!
//! The cached entry is a copy of the last region's span (start, end, host address) and its
//! index. It is only ever filled from the view the translator pins, and
//! [`Translator::refresh`], the one way to change that view, empties it, so the entry can
//! never describe a region of another view: a hit is one unsigned compare against the
//! copied bounds. The index is read with a bounds-checked `get`, so even a wrong index
//! could only miss, never read past the region array; the review of seed 004 asked for
//! exactly this clamp against speculative out-of-bounds loads.
//!
//! A cache costs a thread whose lookups jump between regions (a device worker serving many
//! buffers): a miss is a binary search plus a mispredicted branch and a store. So after
//! `MISS_STREAK_TO_BYPASS` misses in a row the cache steps aside: a lookup then costs one
//! AND and a predictable branch more than the view's own binary search, and one guest page
//! in `BYPASS_PROBE_ONE_IN_PAGES` still tries the cache, to notice when hits return.

use std::cell::Cell;
use std::sync::Arc;

use vm_memory::bitmap::RefSlice;
use vm_memory::{GuestAddress, VolatileSlice};

use crate::dirty::DirtyBitmap;
use crate::map::{GuestMap, MapView, Span};
use crate::region::Region;

/// A region's dirty bitmap as a slice at some offset, or nothing when it tracks no writes:
/// what vm-memory's `VolatileSlice` marks on every write through it.
pub type DirtySlice<'a> = Option<RefSlice<'a, DirtyBitmap>>;

/// Guest memory as handed out by translation and by the device view: a volatile slice that
/// marks the region's dirty bitmap when written.
pub type GuestSlice<'a> = VolatileSlice<'a, DirtySlice<'a>>;

/// The slice of host memory `host..host+len`, `offset` bytes into the region of `span`.
///
/// # Safety
/// `host..host+len` must lie in the region `span` describes, and `span` must come from a
/// view that keeps the region (and its bitmap) alive for `'a`.
#[inline]
pub(crate) unsafe fn guest_slice<'a>(
    host: usize,
    len: usize,
    span: &Span,
    offset: u64,
) -> GuestSlice<'a> {
    let bitmap = span.dirty.map(|p| {
        // SAFETY: the bitmap belongs to the region, which the span's view keeps alive for
        // 'a (this function's contract); it is only read through a shared reference.
        let b: &'a DirtyBitmap = unsafe { p.as_ref() };
        RefSlice::new(b, offset as usize)
    });
    // SAFETY: host..host+len is mapped for 'a (this function's contract).
    unsafe { VolatileSlice::with_bitmap(host as *mut u8, len, bitmap, None) }
}

/// Why a guest range could not be translated.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TranslateError {
    /// `addr + len` overflows u64.
    #[error("guest range {addr:#x} + {len:#x} overflows u64")]
    Overflow {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// No region holds the address.
    #[error("guest address {addr:#x} is not in any region")]
    Unmapped {
        /// The address.
        addr: u64,
    },
    /// The range starts in a region but runs past its end.
    #[error("guest range {addr:#x} + {len:#x} runs past the end of region {region_addr:#x}..{region_end:#x}")]
    CrossesRegionEnd {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// Start of the region holding `addr`.
        region_addr: u64,
        /// Its end (exclusive).
        region_end: u64,
    },
    /// A write to a region the guest may only read.
    #[error("guest range {addr:#x} + {len:#x} is in read-only region {region_addr:#x}")]
    ReadOnly {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len: u64,
        /// Start of the region.
        region_addr: u64,
    },
}

/// After this many misses in a row the cache steps aside (see the module docs).
const MISS_STREAK_TO_BYPASS: u32 = 8;

/// While bypassed, one lookup in this many (chosen by guest page number, so no counter has
/// to be stored per lookup) still goes through the cache, to notice when hits return.
const BYPASS_PROBE_ONE_IN_PAGES: u64 = 128;

/// The guest-address bits that are all clear on the pages that probe the cache while it is
/// bypassed: the low bits of the page number (4 KiB pages).
const BYPASS_MASK: u64 = (BYPASS_PROBE_ONE_IN_PAGES - 1) << 12;

/// A per-thread translator. Not `Sync`: give every thread its own (they are cheap).
pub struct Translator {
    map: GuestMap,
    snap: Arc<MapView>,
    /// The last region found: a copy of its span, so a hit reads only this translator's own
    /// memory; empty (never hits) until the first lookup and after a refresh.
    last: Cell<Span>,
    /// The index of `last` in `snap`.
    last_index: Cell<usize>,
    /// Misses in a row, up to `MISS_STREAK_TO_BYPASS`.
    miss_streak: Cell<u32>,
    /// Zero while the cache is on; [`BYPASS_MASK`] while it steps aside.
    bypass: Cell<u64>,
}

/// A span that holds no address: an empty cache.
const NO_SPAN: Span = Span {
    start: 0,
    end: 0,
    host: 0,
    read_only: false,
    dirty: None,
};

impl std::fmt::Debug for Translator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Translator")
            .field("generation", &self.snap.generation())
            .field("regions", &self.snap.len())
            .finish()
    }
}

impl Clone for Translator {
    fn clone(&self) -> Self {
        Translator {
            map: self.map.clone(),
            snap: self.snap.clone(),
            last: Cell::new(self.last.get()),
            last_index: Cell::new(self.last_index.get()),
            miss_streak: Cell::new(self.miss_streak.get()),
            bypass: Cell::new(self.bypass.get()),
        }
    }
}

impl GuestMap {
    /// A translator for one thread (a vCPU or a device worker).
    pub fn translator(&self) -> Translator {
        Translator::new(self.clone())
    }
}

impl Translator {
    /// A translator over `map`, pinned to its current view.
    pub fn new(map: GuestMap) -> Translator {
        let snap = map.view();
        Translator {
            map,
            snap,
            last: Cell::new(NO_SPAN),
            last_index: Cell::new(0),
            miss_streak: Cell::new(0),
            bypass: Cell::new(0),
        }
    }

    /// Moves to the newest view if the map changed; returns whether it did. One atomic
    /// load when nothing changed. The cache is emptied with the move: it only ever holds a
    /// region of the view this translator pins.
    pub fn refresh(&mut self) -> bool {
        if self.map.generation() == self.snap.generation() {
            return false;
        }
        self.snap = self.map.view();
        self.last.set(NO_SPAN);
        self.miss_streak.set(0);
        self.bypass.set(0);
        true
    }

    /// The view this translator reads.
    #[inline]
    pub fn view(&self) -> &MapView {
        &self.snap
    }

    /// The map this translator belongs to.
    pub fn map(&self) -> &GuestMap {
        &self.map
    }

    /// The index of the region holding `addr`: the cached one if it still holds it, else a
    /// binary search whose answer is cached (see the module docs for when the cache steps
    /// aside).
    #[inline]
    pub fn region_index(&self, addr: GuestAddress) -> Option<usize> {
        if self.bypassed(addr.0) {
            // Only the index: a bypassed lookup costs what the view's own search costs.
            return self.snap.find_index(addr);
        }
        self.cached(addr.0).map(|(i, _)| i)
    }

    /// Whether this lookup skips the cache: it has missed `MISS_STREAK_TO_BYPASS` times in a
    /// row, and `addr` is not on a page that probes it.
    #[inline(always)]
    fn bypassed(&self, addr: u64) -> bool {
        // One load, one AND, one well-predicted branch: the mask is zero while the cache is
        // on, and selects the page-number bits a probe page has clear while it is bypassed.
        addr & self.bypass.get() != 0
    }

    /// The region holding `addr` and its span.
    #[inline]
    fn lookup(&self, addr: u64) -> Option<(usize, Span)> {
        if self.bypassed(addr) {
            let i = self.snap.find_index(GuestAddress(addr))?;
            return self.snap.spans().get(i).map(|s| (i, *s));
        }
        self.cached(addr)
    }

    /// A lookup through the cache: the cached region if it holds `addr`, else a binary
    /// search whose answer is cached.
    #[inline]
    fn cached(&self, addr: u64) -> Option<(usize, Span)> {
        let last = self.last.get();
        // One unsigned compare tells whether `addr` lies in start..end (an empty span never
        // holds it).
        if addr.wrapping_sub(last.start) < last.end - last.start {
            if self.miss_streak.get() != 0 {
                self.miss_streak.set(0);
                self.bypass.set(0);
            }
            return Some((self.last_index.get(), last));
        }
        self.miss(addr)
    }

    /// A cache miss: the binary search, its answer cached, and the streak counted.
    #[inline]
    fn miss(&self, addr: u64) -> Option<(usize, Span)> {
        let index = self.snap.find_index(GuestAddress(addr))?;
        let span = *self.snap.spans().get(index)?;
        self.last.set(span);
        self.last_index.set(index);
        let streak = self.miss_streak.get() + 1;
        if streak <= MISS_STREAK_TO_BYPASS {
            self.miss_streak.set(streak);
            if streak == MISS_STREAK_TO_BYPASS {
                self.bypass.set(BYPASS_MASK);
            }
        }
        Some((index, span))
    }

    /// The region holding `addr`.
    #[inline]
    pub fn find(&self, addr: GuestAddress) -> Option<&Arc<Region>> {
        // `get` clamps the index to the region count: a cached index is only ever used
        // through a bounds check (seed 004's review asked for this against speculation).
        self.region_index(addr)
            .and_then(|i| self.snap.regions().get(i))
    }

    /// The region holding `addr`, through the cache (what vm-memory's `find_region` does,
    /// with seed 004's last-used cache in front).
    #[inline]
    pub fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.find(addr).map(|r| &**r)
    }

    /// Host address of `addr..addr+len`, which must lie in one region, and the region's span.
    #[inline]
    fn host_range(&self, addr: GuestAddress, len: usize) -> Result<(usize, Span), TranslateError> {
        let len64 = len as u64;
        match self.lookup(addr.0) {
            Some((_, s)) if len64 <= s.end - addr.0 => {
                Ok((s.host + (addr.0 - s.start) as usize, s))
            }
            found => Err(self.miss_error(addr.0, len64, found.map(|(_, s)| s))),
        }
    }

    /// The error for a failed translation, in the order overflow, hole, region end.
    #[cold]
    fn miss_error(&self, addr: u64, len: u64, span: Option<Span>) -> TranslateError {
        if addr.checked_add(len).is_none() {
            return TranslateError::Overflow { addr, len };
        }
        match span {
            None => TranslateError::Unmapped { addr },
            Some(s) => TranslateError::CrossesRegionEnd {
                addr,
                len,
                region_addr: s.start,
                region_end: s.end,
            },
        }
    }

    /// The host memory of `addr..addr+len` for reading. The range must lie in one region.
    /// (A `VolatileSlice` cannot be made read-only: write through
    /// [`Translator::translate_mut`], which refuses read-only regions; a write through this
    /// slice is still marked dirty.)
    #[inline]
    pub fn translate(
        &self,
        addr: GuestAddress,
        len: usize,
    ) -> Result<GuestSlice<'_>, TranslateError> {
        let (host, span) = self.host_range(addr, len)?;
        // SAFETY: host..host+len lies in the region of `span` (checked in host_range, without
        // overflow), which came from `self.snap`; the view holds the region's Arc, so the
        // mapping and bitmap outlive the returned slice, which borrows `self`.
        Ok(unsafe { guest_slice(host, len, &span, addr.0 - span.start) })
    }

    /// The host memory of `addr..addr+len` for writing: as [`Translator::translate`], and the
    /// region must not be read-only to the guest.
    #[inline]
    pub fn translate_mut(
        &self,
        addr: GuestAddress,
        len: usize,
    ) -> Result<GuestSlice<'_>, TranslateError> {
        let (host, span) = self.host_range(addr, len)?;
        if span.read_only {
            return Err(TranslateError::ReadOnly {
                addr: addr.0,
                len: len as u64,
                region_addr: span.start,
            });
        }
        // SAFETY: as in `translate`: the range was checked to lie in the region of `span`,
        // which the pinned view keeps mapped.
        Ok(unsafe { guest_slice(host, len, &span, addr.0 - span.start) })
    }

    /// Copies guest memory at `addr` into `buf`, all of it from one region (a range that
    /// crosses a region's end is refused). Named apart from vm-memory's `Bytes::read`, which
    /// takes its arguments the other way round, may cross regions and returns a count.
    pub fn read_in_region(&self, addr: GuestAddress, buf: &mut [u8]) -> Result<(), TranslateError> {
        self.translate(addr, buf.len())?.copy_to(buf);
        Ok(())
    }

    /// Copies `buf` into guest memory at `addr`, all of it into one region, which must not
    /// be read-only; the pages are marked dirty if the region tracks writes. Named apart
    /// from vm-memory's `Bytes::write` (see [`Translator::read_in_region`]).
    pub fn write_in_region(&self, addr: GuestAddress, buf: &[u8]) -> Result<(), TranslateError> {
        self.translate_mut(addr, buf.len())?.copy_from(buf);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{Access, RegionSpec};

    fn map2() -> GuestMap {
        GuestMap::from_specs(&[
            RegionSpec::new(GuestAddress(0x1_0000), 0x1_0000),
            RegionSpec::new(GuestAddress(0x4_0000), 0x2_0000),
        ])
        .unwrap()
    }

    #[test]
    fn translate_hole_is_unmapped() {
        let t = map2().translator();
        assert_eq!(
            t.translate(GuestAddress(0x2_0000), 1).unwrap_err(),
            TranslateError::Unmapped { addr: 0x2_0000 }
        );
        assert!(t.translate(GuestAddress(0), 1).is_err());
        assert!(t.translate(GuestAddress(0x6_0000), 1).is_err());
    }

    #[test]
    fn translate_crossing_end_is_refused() {
        let t = map2().translator();
        let e = t.translate(GuestAddress(0x1_fff0), 0x20).unwrap_err();
        assert!(matches!(
            e,
            TranslateError::CrossesRegionEnd {
                region_end: 0x2_0000,
                ..
            }
        ));
        assert!(t.translate(GuestAddress(0x1_fff0), 0x10).is_ok());
    }

    #[test]
    fn translate_wrapping_range_is_overflow() {
        let t = map2().translator();
        let e = t.translate(GuestAddress(u64::MAX - 4), 16).unwrap_err();
        assert!(matches!(e, TranslateError::Overflow { .. }));
    }

    #[test]
    fn write_read_only_region_is_refused() {
        let map = GuestMap::from_specs(&[
            RegionSpec::new(GuestAddress(0), 0x1000).with_access(Access::ReadOnly)
        ])
        .unwrap();
        let t = map.translator();
        assert!(matches!(
            t.write_in_region(GuestAddress(0x10), &[1]).unwrap_err(),
            TranslateError::ReadOnly { region_addr: 0, .. }
        ));
        let mut b = [9u8];
        t.read_in_region(GuestAddress(0x10), &mut b).unwrap();
        assert_eq!(b, [0]);
    }

    #[test]
    fn write_lands_at_host_address_of_region() {
        let map = map2();
        let t = map.translator();
        t.write_in_region(GuestAddress(0x4_1234), &[1, 2, 3])
            .unwrap();
        let r = t.find(GuestAddress(0x4_0000)).unwrap();
        // SAFETY: 0x1234 + 3 lies inside the 0x2_0000-byte region, which `t` keeps mapped.
        let host = unsafe { std::slice::from_raw_parts(r.host_addr().add(0x1234), 3) };
        assert_eq!(host, &[1, 2, 3]);
    }

    #[test]
    fn cache_steps_aside_on_miss_streak_and_returns_on_hit() {
        // Region 1's first page (0x100) is a probe page; its next page (0x101) is not.
        let map = GuestMap::from_specs(&[
            RegionSpec::new(GuestAddress(0), 0x1_0000),
            RegionSpec::new(GuestAddress(0x10_0000), 0x1_0000),
        ])
        .unwrap();
        let t = map.translator();
        for k in 0..32u64 {
            let a = if k % 2 == 0 { 0x1000 } else { 0x10_1000 };
            assert!(t.region_index(GuestAddress(a)).is_some());
        }
        assert_eq!(t.miss_streak.get(), MISS_STREAK_TO_BYPASS);
        for _ in 0..16 {
            assert_eq!(t.region_index(GuestAddress(0x10_1000)), Some(1));
        }
        assert_eq!(
            t.miss_streak.get(),
            MISS_STREAK_TO_BYPASS,
            "bypassed lookups cache nothing"
        );
        for _ in 0..2 {
            assert_eq!(t.region_index(GuestAddress(0x10_0000)), Some(1));
        }
        assert_eq!(
            t.miss_streak.get(),
            0,
            "a probe hit turns the cache back on"
        );
        assert_eq!(t.region_index(GuestAddress(0x10_1000)), Some(1));
    }

    #[test]
    fn refresh_sees_hot_added_region() {
        let map = map2();
        let mut t = map.translator();
        map.add(&RegionSpec::new(GuestAddress(0x10_0000), 0x1000))
            .unwrap();
        assert!(t.translate(GuestAddress(0x10_0000), 1).is_err());
        assert!(t.refresh());
        assert!(!t.refresh());
        assert!(t.translate(GuestAddress(0x10_0000), 1).is_ok());
    }
}
