//! The guest physical address map: sorted, non-overlapping regions in immutable views.
//!
//! Readers load the current [`MapView`] (an `Arc`, through `arc-swap`, which never blocks
//! and is never blocked by a writer) and keep it as long as they like. Hot-add and
//! hot-remove build a new view under a writer mutex and publish it with a new
//! generation number; a removed region stays mapped until the last view (or handle) that
//! holds it is dropped, so a reader can never touch unmapped memory. This is RCU, with
//! reference counts standing in for grace periods.
//!
//! The view keeps the hot part of every region (start, end, host address) in one dense
//! array, so the binary search touches one cache line per step and no `Arc` at all.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use arc_swap::ArcSwap;
use vm_memory::GuestAddress;

use crate::host::{Demand, Host, HostError, Stage};
use crate::layout::{RegionSpec, MAX_REGIONS};
use crate::region::{Region, RegionError};

/// Why the map refused a change. Nothing is mapped or published when one is returned.
#[derive(Debug, thiserror::Error)]
pub enum MapError {
    /// The map would hold more than [`MAX_REGIONS`] regions.
    #[error("region at {addr:#x}: the map already holds {limit} regions, its limit (KVM's memslot count)")]
    TooManyRegions {
        /// Guest address of the region refused.
        addr: u64,
        /// The limit.
        limit: usize,
    },
    /// Two regions overlap.
    #[error("region {addr:#x}..{end:#x} overlaps region {other_addr:#x}..{other_end:#x}")]
    Overlap {
        /// Start of the region refused.
        addr: u64,
        /// End (exclusive) of the region refused.
        end: u64,
        /// Start of the region it overlaps.
        other_addr: u64,
        /// End (exclusive) of the region it overlaps.
        other_end: u64,
    },
    /// No region starts at this guest address.
    #[error("no region starts at guest address {addr:#x}")]
    NotFound {
        /// The address asked for.
        addr: u64,
    },
    /// The region itself could not be mapped.
    #[error(transparent)]
    Region(#[from] RegionError),
    /// The host cannot give what the regions need together (hugetlb pool, mappings).
    #[error(transparent)]
    Host(#[from] HostError),
}

/// The part of a region that translation reads, kept densely in a view (and copied into
/// each translator's cache), so a lookup never follows a region's `Arc`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Span {
    pub(crate) start: u64,
    /// Exclusive end; never overflows (regions that would are refused).
    pub(crate) end: u64,
    pub(crate) host: usize,
    /// Whether the guest may only read it.
    pub(crate) read_only: bool,
    /// The region's dirty bitmap, if it tracks writes. Valid while the view that made
    /// the span holds the region's `Arc` (every holder of a span also holds that view).
    pub(crate) dirty: Option<std::ptr::NonNull<crate::dirty::DirtyBitmap>>,
}

// SAFETY: a Span is plain data about a region; the bitmap pointer is only dereferenced by
// holders of the view that keeps the region (and its bitmap, which is Sync) alive.
unsafe impl Send for Span {}
// SAFETY: as above.
unsafe impl Sync for Span {}

/// The regions of one view, sorted, with the dense arrays lookups search: vm-memory's
/// `GuestMemoryBackend` over them is the reference for what the device view does across
/// region edges (see `vm_memory_impl`).
#[derive(Debug)]
pub struct RegionTable {
    /// Region starts alone, 8 bytes each, for the binary search: 8 per cache line.
    starts: Box<[u64]>,
    spans: Box<[Span]>,
    regions: Box<[Arc<Region>]>,
}

impl RegionTable {
    fn new(mut regions: Vec<Arc<Region>>) -> RegionTable {
        regions.sort_by_key(|r| r.guest_addr().0);
        let spans = regions
            .iter()
            .map(|r| Span {
                start: r.guest_addr().0,
                end: r.guest_end(),
                host: r.host_addr() as usize,
                read_only: r.access() == crate::layout::Access::ReadOnly,
                dirty: r.dirty_bitmap().map(std::ptr::NonNull::from),
            })
            .collect();
        let starts = regions.iter().map(|r| r.guest_addr().0).collect();
        RegionTable {
            starts,
            spans,
            regions: regions.into_boxed_slice(),
        }
    }

    /// The regions, sorted by guest address.
    #[inline]
    pub fn regions(&self) -> &[Arc<Region>] {
        &self.regions
    }

    #[inline]
    pub(crate) fn spans(&self) -> &[Span] {
        &self.spans
    }

    /// The index of the region holding `addr`, by binary search.
    #[inline]
    pub fn find_index(&self, addr: GuestAddress) -> Option<usize> {
        let i = self
            .starts
            .partition_point(|&s| s <= addr.0)
            .checked_sub(1)?;
        (addr.0 < self.spans[i].end).then_some(i)
    }
}

/// An immutable view of the map at one generation.
///
/// It is also what device code gets: vm-memory's `GuestMemory`, with `Permissions` honoured
/// (a write into a read-only region is refused, nothing written) and every write marked in
/// the region's dirty bitmap if it tracks writes.
#[derive(Debug)]
pub struct MapView {
    generation: u64,
    table: RegionTable,
}

impl MapView {
    fn new(generation: u64, regions: Vec<Arc<Region>>) -> MapView {
        MapView {
            generation,
            table: RegionTable::new(regions),
        }
    }

    /// The generation: it grows by one with every published change.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// The regions, sorted by guest address.
    #[inline]
    pub fn regions(&self) -> &[Arc<Region>] {
        self.table.regions()
    }

    /// The regions as vm-memory's `GuestMemoryBackend`: vm-memory's own semantics with no
    /// permission check, for host-side code that means it (loading a ROM image, say). Device
    /// code takes the view itself.
    #[inline]
    pub fn table(&self) -> &RegionTable {
        &self.table
    }

    /// The number of regions.
    pub fn len(&self) -> usize {
        self.table.regions.len()
    }

    /// Whether the map is empty.
    pub fn is_empty(&self) -> bool {
        self.table.regions.is_empty()
    }

    /// Total bytes of guest memory.
    pub fn total_bytes(&self) -> u64 {
        self.table.spans.iter().map(|s| s.end - s.start).sum()
    }

    #[inline]
    pub(crate) fn spans(&self) -> &[Span] {
        self.table.spans()
    }

    /// The index of the region holding `addr`, by binary search.
    #[inline]
    pub fn find_index(&self, addr: GuestAddress) -> Option<usize> {
        self.table.find_index(addr)
    }

    /// The region holding `addr`, by binary search.
    pub fn find(&self, addr: GuestAddress) -> Option<&Arc<Region>> {
        self.find_index(addr).map(|i| &self.table.regions[i])
    }

    /// The region holding `addr`, by binary search (what vm-memory's `find_region` does).
    pub fn find_region(&self, addr: GuestAddress) -> Option<&Region> {
        self.find(addr).map(|r| &**r)
    }

    fn overlap(&self, start: u64, end: u64) -> Option<&Span> {
        let spans = &self.table.spans;
        let i = spans.partition_point(|s| s.end <= start);
        spans.get(i).filter(|s| s.start < end)
    }
}

pub(crate) struct Shared {
    pub(crate) current: ArcSwap<MapView>,
    /// Mirrors `current.generation`, so a translator can learn it is stale with one load.
    pub(crate) generation: AtomicU64,
    writer: Mutex<()>,
}

/// The guest memory map. Cloning it gives another handle to the same map.
#[derive(Clone)]
pub struct GuestMap {
    pub(crate) shared: Arc<Shared>,
}

impl std::fmt::Debug for GuestMap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GuestMap")
            .field("view", &self.view())
            .finish()
    }
}

impl Default for GuestMap {
    fn default() -> Self {
        Self::new()
    }
}

impl GuestMap {
    /// An empty map at generation 0.
    pub fn new() -> GuestMap {
        GuestMap {
            shared: Arc::new(Shared {
                current: ArcSwap::from_pointee(MapView::new(0, Vec::new())),
                generation: AtomicU64::new(0),
                writer: Mutex::new(()),
            }),
        }
    }

    /// A map with the regions `specs` describe, checked for overlaps and count before any of
    /// them is mapped; if one fails to map, those already mapped are unmapped again.
    pub fn from_specs(specs: &[RegionSpec]) -> Result<GuestMap, MapError> {
        GuestMap::from_specs_on(specs, &Host::read())
    }

    /// [`GuestMap::from_specs`] against host facts already read.
    pub(crate) fn from_specs_on(specs: &[RegionSpec], host: &Host) -> Result<GuestMap, MapError> {
        if specs.len() > MAX_REGIONS {
            return Err(MapError::TooManyRegions {
                addr: specs[MAX_REGIONS].guest_addr().0,
                limit: MAX_REGIONS,
            });
        }
        let mut ranges = Vec::with_capacity(specs.len());
        for s in specs {
            let end = s.guest_end().ok_or(RegionError::Overflow {
                addr: s.guest_addr().0,
                size: s.size(),
            })?;
            ranges.push((s.guest_addr().0, end));
        }
        ranges.sort_unstable();
        for w in ranges.windows(2) {
            if w[1].0 < w[0].1 {
                return Err(MapError::Overlap {
                    addr: w[1].0,
                    end: w[1].1,
                    other_addr: w[0].0,
                    other_end: w[0].1,
                });
            }
        }
        // What the regions need together (a pool each region alone would fit, the mapping
        // count), checked once; each region is then mapped without a check of its own.
        let demands: Vec<Demand> = specs.iter().map(Demand::of_spec).collect();
        host.check(&demands, Stage::Map)?;
        let regions = specs
            .iter()
            .map(|s| Region::map_on(s, host).map(Arc::new))
            .collect::<Result<Vec<_>, _>>()?;
        let map = GuestMap::new();
        map.publish(MapView::new(1, regions));
        Ok(map)
    }

    /// The current view. Cheap; never blocks.
    pub fn view(&self) -> Arc<MapView> {
        self.shared.current.load_full()
    }

    /// The current generation: one atomic load.
    pub fn generation(&self) -> u64 {
        self.shared.generation.load(Ordering::Acquire)
    }

    fn publish(&self, snap: MapView) {
        let generation = snap.generation;
        self.shared.current.store(Arc::new(snap));
        self.shared.generation.store(generation, Ordering::Release);
    }

    /// Maps a new region and publishes it (hot-add).
    pub fn add(&self, spec: &RegionSpec) -> Result<Arc<Region>, MapError> {
        let addr = spec.guest_addr().0;
        let end = spec.guest_end().ok_or(RegionError::Overflow {
            addr,
            size: spec.size(),
        })?;
        // Refuse early, before mapping anything; `insert` checks again under the lock.
        self.check_fits(&self.view(), addr, end)?;
        let region = Arc::new(Region::map(spec)?);
        self.insert(region.clone())?;
        Ok(region)
    }

    /// Publishes a region mapped beforehand (hot-add), e.g. one the VMM has already loaded
    /// or populated, so that no reader ever sees it half-prepared.
    pub fn insert(&self, region: Arc<Region>) -> Result<(), MapError> {
        let _w = self.shared.writer.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.shared.current.load_full();
        self.check_fits(&cur, region.guest_addr().0, region.guest_end())?;
        let mut regions = cur.regions().to_vec();
        regions.push(region);
        self.publish(MapView::new(cur.generation + 1, regions));
        Ok(())
    }

    fn check_fits(&self, cur: &MapView, addr: u64, end: u64) -> Result<(), MapError> {
        if cur.len() >= MAX_REGIONS {
            return Err(MapError::TooManyRegions {
                addr,
                limit: MAX_REGIONS,
            });
        }
        if let Some(o) = cur.overlap(addr, end) {
            return Err(MapError::Overlap {
                addr,
                end,
                other_addr: o.start,
                other_end: o.end,
            });
        }
        Ok(())
    }

    /// Removes the region that starts at `addr` and publishes the map without it
    /// (hot-remove). It stays mapped until the returned handle and every view that holds
    /// it are dropped.
    pub fn remove(&self, addr: GuestAddress) -> Result<Arc<Region>, MapError> {
        let _w = self.shared.writer.lock().unwrap_or_else(|e| e.into_inner());
        let cur = self.shared.current.load_full();
        let i = cur
            .regions()
            .iter()
            .position(|r| r.guest_addr() == addr)
            .ok_or(MapError::NotFound { addr: addr.0 })?;
        let mut regions = cur.regions().to_vec();
        let removed = regions.remove(i);
        self.publish(MapView::new(cur.generation + 1, regions));
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(addr: u64, size: u64) -> RegionSpec {
        RegionSpec::new(GuestAddress(addr), size)
    }

    #[test]
    fn from_specs_overlap_is_refused_before_mapping() {
        let e = GuestMap::from_specs(&[spec(0, 0x4000), spec(0x3000, 0x1000)]).unwrap_err();
        assert!(
            matches!(
                e,
                MapError::Overlap {
                    addr: 0x3000,
                    other_addr: 0,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn add_overlap_is_refused_and_generation_unchanged() {
        let map = GuestMap::from_specs(&[spec(0x10000, 0x10000)]).unwrap();
        let g = map.generation();
        let e = map.add(&spec(0x1f000, 0x2000)).unwrap_err();
        assert!(matches!(e, MapError::Overlap { .. }), "{e}");
        assert_eq!(map.generation(), g);
        assert_eq!(map.view().len(), 1);
    }

    #[test]
    fn remove_keeps_region_mapped_for_old_view() {
        let map = GuestMap::from_specs(&[spec(0, 0x10000), spec(0x20000, 0x10000)]).unwrap();
        let old = map.view();
        let r = &old.regions()[1];
        // SAFETY: the region maps 0x10000 writable bytes and this test is its only user.
        unsafe { r.host_addr().write_volatile(7) };
        let removed = map.remove(GuestAddress(0x20000)).unwrap();
        drop(removed);
        assert_eq!(map.view().len(), 1);
        // Still mapped: the old view holds it.
        // SAFETY: as above; `old` keeps the mapping alive.
        assert_eq!(unsafe { r.host_addr().read_volatile() }, 7);
        assert!(map.view().find(GuestAddress(0x20000)).is_none());
    }

    #[test]
    fn remove_unknown_address_is_refused() {
        let map = GuestMap::from_specs(&[spec(0, 0x10000)]).unwrap();
        let e = map.remove(GuestAddress(0x1000)).unwrap_err();
        assert!(matches!(e, MapError::NotFound { addr: 0x1000 }), "{e}");
    }
}
