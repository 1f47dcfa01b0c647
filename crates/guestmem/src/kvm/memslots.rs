//! The regions of a map snapshot registered as KVM memslots.
//!
//! [`Memslots::sync`] diffs the registered slots against a snapshot by region id: slots of
//! regions that left the map are deleted first (freeing their numbers and guest ranges), then
//! the new regions are added. Every registered slot holds its region's `Arc`, so however the
//! map changes, a region stays mapped until KVM no longer maps it. Every check that can fail
//! without KVM (slot count, read-only support) is made before any slot is touched; if KVM
//! refuses a region, the slots this call added are deleted again before the error returns.
//!
//! Each slot with dirty logging owns a [`DirtyBitmap`] and a reused `SlotLog`;
//! [`Memslots::harvest`] moves KVM's log into the bitmaps, and [`Memslots::mark`] records
//! the VMM's own writes in the same bitmaps, so a migration sees both.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_bindings::{
    kvm_userspace_memory_region, kvm_userspace_memory_region2, KVM_MEM_LOG_DIRTY_PAGES,
    KVM_MEM_READONLY,
};
use vm_memory::GuestAddress;

use super::dirty::SlotLog;
use super::{KvmError, KvmVm};
use crate::dirty::DirtyBitmap;
use crate::layout::Access;
use crate::map::MapView;
use crate::region::Region;

pub use crate::dirty::DIRTY_PAGE_BYTES;

/// Whether read-write slots log dirty pages (`KVM_MEM_LOG_DIRTY_PAGES`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DirtyLogging {
    /// Log dirty pages. KVM then maps the slot with 4 KiB pages.
    On,
    /// Do not log.
    Off,
}

/// How regions become slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemslotConfig {
    /// Dirty logging for read-write slots (read-only slots never log: the guest cannot
    /// write them).
    pub dirty_logging: DirtyLogging,
    /// At most this many slots (`None`: KVM's `KVM_CAP_NR_MEMSLOTS`), for a VMM that keeps
    /// slots back for devices.
    pub max_slots: Option<usize>,
}

/// Dirty logging off: KVM then maps guest memory with the largest pages the host mapping
/// allows (2 MiB for THP or hugetlb regions laid out congruent). Turn it on with
/// [`Memslots::set_dirty_logging`] when a migration or snapshot starts, and off when it ends:
/// while it is on, KVM write-protects and maps every page at 4 KiB.
impl Default for MemslotConfig {
    fn default() -> Self {
        MemslotConfig {
            dirty_logging: DirtyLogging::Off,
            max_slots: None,
        }
    }
}

/// A registered slot, as plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct SlotInfo {
    /// KVM slot number.
    pub slot: u32,
    /// Id of the region it maps ([`Region::id`]).
    pub region_id: u64,
    /// Guest physical address.
    pub guest_addr: u64,
    /// Size in bytes.
    pub size: u64,
    /// Host address.
    pub host_addr: u64,
    /// `KVM_MEM_*` flags.
    pub flags: u32,
}

/// What one [`Memslots::sync`] did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Slots added.
    pub added: Vec<SlotInfo>,
    /// Slots deleted.
    pub removed: Vec<SlotInfo>,
    /// Regions KVM accepted but cannot map well (host and guest addresses not congruent
    /// modulo the region's huge-page size: KVM will map them with small pages).
    pub warnings: Vec<String>,
}

/// What one [`Memslots::harvest`] found and how long it took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HarvestStats {
    /// Slots harvested.
    pub slots: usize,
    /// Dirty pages KVM reported.
    pub dirty_pages: u64,
    /// Time in `KVM_GET_DIRTY_LOG` and merging, all slots.
    pub get: Duration,
    /// Time in `KVM_CLEAR_DIRTY_LOG`, all slots (zero without manual protection).
    pub clear: Duration,
}

#[derive(Debug)]
struct Slot {
    id: u32,
    region: Arc<Region>,
    flags: u32,
    /// The slot's own bitmap, for a region that keeps none; a region that tracks writes
    /// ([`crate::layout::DirtyTracking::On`]) lends its own, so KVM's log and the device
    /// writes vm-memory marked land in one set.
    own: Option<DirtyBitmap>,
    log: SlotLog,
}

impl Slot {
    fn info(&self) -> SlotInfo {
        SlotInfo {
            slot: self.id,
            region_id: self.region.id(),
            guest_addr: self.region.guest_addr().0,
            size: self.region.size(),
            host_addr: self.region.host_addr() as u64,
            flags: self.flags,
        }
    }

    fn logs(&self) -> bool {
        self.flags & KVM_MEM_LOG_DIRTY_PAGES != 0
    }

    fn bitmap(&self) -> &DirtyBitmap {
        match (self.region.dirty_bitmap(), &self.own) {
            (Some(b), _) | (None, Some(b)) => b,
            (None, None) => unreachable!("a slot's region without a bitmap gets its own"),
        }
    }
}

/// The memslots of one VM, mirroring a map.
#[derive(Debug)]
pub struct Memslots {
    vm: Arc<KvmVm>,
    config: MemslotConfig,
    /// Sorted by guest address.
    slots: Vec<Slot>,
    /// Slot numbers freed by deletions, reused first.
    free: Vec<u32>,
    next: u32,
}

impl Memslots {
    /// The VM's memslot registry, with no slots yet; call [`Memslots::sync`]. A VM has at
    /// most one at a time ([`KvmError::MemslotsTaken`] otherwise): it alone numbers the VM's
    /// slots, so the dirty-log buffer of each slot number is always sized from that slot.
    pub fn new(vm: Arc<KvmVm>, config: MemslotConfig) -> Result<Memslots, KvmError> {
        if vm
            .memslots_taken
            .swap(true, std::sync::atomic::Ordering::AcqRel)
        {
            return Err(KvmError::MemslotsTaken);
        }
        Ok(Memslots {
            vm,
            config,
            slots: Vec::new(),
            free: Vec::new(),
            next: 0,
        })
    }

    /// The VM.
    pub fn vm(&self) -> &Arc<KvmVm> {
        &self.vm
    }

    /// The registered slots, by guest address.
    pub fn slots(&self) -> Vec<SlotInfo> {
        self.slots.iter().map(Slot::info).collect()
    }

    /// Makes the slots mirror `snap`: deletes slots whose region left it, adds its new
    /// regions. On error nothing this call added stays registered.
    pub fn sync(&mut self, snap: &MapView) -> Result<SyncReport, KvmError> {
        let wanted = snap.regions();
        let to_add: Vec<&Arc<Region>> = wanted
            .iter()
            .filter(|r| !self.slots.iter().any(|s| s.region.id() == r.id()))
            .collect();
        let keep = self
            .slots
            .iter()
            .filter(|s| wanted.iter().any(|r| r.id() == s.region.id()))
            .count();
        let kvm_limit = self.vm.caps().nr_memslots;
        let limit = self
            .config
            .max_slots
            .map_or(kvm_limit, |m| m.min(kvm_limit));
        if keep + to_add.len() > limit {
            return Err(KvmError::TooManySlots {
                needed: keep + to_add.len(),
                limit,
                addr: to_add[limit.saturating_sub(keep).min(to_add.len() - 1)]
                    .guest_addr()
                    .0,
            });
        }
        if !self.vm.caps().readonly_mem {
            if let Some(r) = to_add.iter().find(|r| r.access() == Access::ReadOnly) {
                return Err(KvmError::ReadOnlyUnsupported {
                    addr: r.guest_addr().0,
                });
            }
        }

        let mut report = SyncReport::default();
        let mut i = 0;
        while i < self.slots.len() {
            if wanted.iter().any(|r| r.id() == self.slots[i].region.id()) {
                i += 1;
                continue;
            }
            let info = self.slots[i].info();
            self.delete_kvm_slot(&info)?;
            let gone = self.slots.remove(i);
            self.free.push(gone.id);
            report.removed.push(info);
        }

        let mut added: Vec<u32> = Vec::new();
        for r in to_add {
            match self.add(r) {
                Ok(info) => {
                    added.push(info.slot);
                    report.added.push(info);
                    if let Some(w) = congruence_warning(r) {
                        report.warnings.push(w);
                    }
                }
                Err(e) => {
                    for id in added {
                        self.remove_by_id(id);
                    }
                    return Err(e);
                }
            }
        }
        Ok(report)
    }

    fn flags_for(&self, r: &Region, logging: DirtyLogging) -> u32 {
        match r.access() {
            Access::ReadOnly => KVM_MEM_READONLY,
            Access::ReadWrite if logging == DirtyLogging::On => KVM_MEM_LOG_DIRTY_PAGES,
            Access::ReadWrite => 0,
        }
    }

    fn add(&mut self, r: &Arc<Region>) -> Result<SlotInfo, KvmError> {
        let id = self.free.pop().unwrap_or_else(|| {
            self.next += 1;
            self.next - 1
        });
        let flags = self.flags_for(r, self.config.dirty_logging);
        let own = match r.dirty_bitmap() {
            Some(_) => None,
            None => Some(DirtyBitmap::new(r.size(), DIRTY_PAGE_BYTES)?),
        };
        let pages = r.size().div_ceil(DIRTY_PAGE_BYTES);
        let slot = Slot {
            id,
            region: r.clone(),
            flags,
            log: SlotLog::new(id, pages),
            own,
        };
        let info = slot.info();
        if let Err(e) = self.set_kvm_slot(&info, SlotOp::Add) {
            self.free.push(id);
            return Err(e);
        }
        let at = self
            .slots
            .partition_point(|s| s.region.guest_addr() < r.guest_addr());
        self.slots.insert(at, slot);
        Ok(info)
    }

    fn remove_by_id(&mut self, id: u32) {
        if let Some(i) = self.slots.iter().position(|s| s.id == id) {
            let info = self.slots[i].info();
            // Only undoing a slot this call just added: if KVM refuses even that, keep the
            // region's Arc (leak the slot) rather than unmap memory KVM may still map.
            if self.delete_kvm_slot(&info).is_ok() {
                self.slots.remove(i);
                self.free.push(id);
            }
        }
    }

    fn delete_kvm_slot(&self, info: &SlotInfo) -> Result<(), KvmError> {
        let gone = SlotInfo { size: 0, ..*info };
        self.set_kvm_slot(&gone, SlotOp::Delete)
            .map_err(|e| match e {
                KvmError::Slot {
                    slot, op, source, ..
                } => KvmError::Slot {
                    slot,
                    addr: info.guest_addr,
                    size: info.size,
                    host: info.host_addr,
                    op,
                    source,
                },
                other => other,
            })
    }

    /// One `KVM_SET_USER_MEMORY_REGION(2)`; `info.size == 0` deletes the slot.
    fn set_kvm_slot(&self, info: &SlotInfo, what: SlotOp) -> Result<(), KvmError> {
        let vm = &self.vm.vm;
        let (res, op) = if self.vm.caps().user_memory2 {
            let mr = kvm_userspace_memory_region2 {
                slot: info.slot,
                flags: info.flags,
                guest_phys_addr: info.guest_addr,
                memory_size: info.size,
                userspace_addr: info.host_addr,
                ..Default::default()
            };
            // SAFETY: host_addr..+size maps a region whose Arc this registry holds while the
            // slot exists (`Slot::region`, dropped only after a successful delete); regions
            // never overlap (the map checks), and a deleted slot (size 0) names no memory.
            (unsafe { vm.set_user_memory_region2(mr) }, what.name(true))
        } else {
            let mr = kvm_userspace_memory_region {
                slot: info.slot,
                flags: info.flags,
                guest_phys_addr: info.guest_addr,
                memory_size: info.size,
                userspace_addr: info.host_addr,
            };
            // SAFETY: as above: the region's Arc is held while the slot exists.
            (unsafe { vm.set_user_memory_region(mr) }, what.name(false))
        };
        res.map_err(|e| KvmError::Slot {
            slot: info.slot,
            addr: info.guest_addr,
            size: info.size,
            host: info.host_addr,
            op,
            source: std::io::Error::from_raw_os_error(e.errno()),
        })
    }

    /// Turns dirty logging on or off for every read-write slot (flags changed in place, as
    /// `dirty_log_perf_test` does between populating and dirtying).
    pub fn set_dirty_logging(&mut self, logging: DirtyLogging) -> Result<(), KvmError> {
        self.config.dirty_logging = logging;
        for i in 0..self.slots.len() {
            let flags = self.flags_for(&self.slots[i].region, logging);
            if flags == self.slots[i].flags {
                continue;
            }
            let info = SlotInfo {
                flags,
                ..self.slots[i].info()
            };
            self.set_kvm_slot(&info, SlotOp::Flags)?;
            self.slots[i].flags = flags;
        }
        Ok(())
    }

    /// Moves KVM's dirty log of every logging slot into its bitmap: all
    /// `KVM_GET_DIRTY_LOG`s first, then (with manual protection) all `KVM_CLEAR_DIRTY_LOG`s,
    /// timed apart. Buffers are reused; nothing is allocated.
    pub fn harvest(&mut self) -> Result<HarvestStats, KvmError> {
        let vm = &self.vm.vm;
        let mut stats = HarvestStats::default();
        let t = Instant::now();
        for s in self.slots.iter_mut().filter(|s| s.logs()) {
            s.log.get(vm)?;
            s.bitmap().merge_words(0, s.log.words())?;
            stats.dirty_pages += s
                .log
                .words()
                .iter()
                .map(|w| u64::from(w.count_ones()))
                .sum::<u64>();
            stats.slots += 1;
        }
        stats.get = t.elapsed();
        if self.vm.caps().manual_protect {
            let t = Instant::now();
            for s in self.slots.iter_mut().filter(|s| s.logs()) {
                s.log.clear(vm)?;
            }
            stats.clear = t.elapsed();
        }
        Ok(stats)
    }

    fn find(&self, addr: u64) -> Option<&Slot> {
        let i = self.slots.partition_point(|s| s.region.guest_end() <= addr);
        self.slots
            .get(i)
            .filter(|s| s.region.guest_addr().0 <= addr)
    }

    /// Records a host write to `addr..addr+len` (a device model writing guest memory
    /// through a [`crate::Translator`]) in the slot's bitmap, next to what KVM reports.
    pub fn mark(&self, addr: GuestAddress, len: u64) -> Result<(), KvmError> {
        let s = self
            .find(addr.0)
            .filter(|s| s.region.contains_range(addr.0, len))
            .ok_or(KvmError::NoSlot { addr: addr.0, len })?;
        s.bitmap().mark(addr.0 - s.region.guest_addr().0, len)?;
        Ok(())
    }

    /// The dirty bitmap of the slot holding `addr` (page 0 is the slot's first page): the
    /// region's own if it tracks writes (then device writes through vm-memory are in it
    /// already), else the slot's.
    pub fn bitmap(&self, addr: GuestAddress) -> Option<&DirtyBitmap> {
        self.find(addr.0).map(Slot::bitmap)
    }
}

impl Drop for Memslots {
    fn drop(&mut self) {
        // Delete every slot before the regions' Arcs go, so KVM never maps unmapped memory.
        // A slot KVM refuses to delete keeps its region mapped (leaked) instead.
        let mut all_deleted = true;
        for s in std::mem::take(&mut self.slots) {
            if self.delete_kvm_slot(&s.info()).is_err() {
                std::mem::forget(s.region);
                all_deleted = false;
            }
        }
        // A slot KVM would not delete keeps its number: no new registry may reuse it.
        if all_deleted {
            self.vm
                .memslots_taken
                .store(false, std::sync::atomic::Ordering::Release);
        }
    }
}

/// Which use of `KVM_SET_USER_MEMORY_REGION(2)`, for error messages.
#[derive(Debug, Clone, Copy)]
enum SlotOp {
    Add,
    Delete,
    Flags,
}

impl SlotOp {
    fn name(self, v2: bool) -> &'static str {
        match (self, v2) {
            (SlotOp::Add, true) => "KVM_SET_USER_MEMORY_REGION2",
            (SlotOp::Add, false) => "KVM_SET_USER_MEMORY_REGION",
            (SlotOp::Delete, true) => "KVM_SET_USER_MEMORY_REGION2 (delete)",
            (SlotOp::Delete, false) => "KVM_SET_USER_MEMORY_REGION (delete)",
            (SlotOp::Flags, true) => "KVM_SET_USER_MEMORY_REGION2 (flags)",
            (SlotOp::Flags, false) => "KVM_SET_USER_MEMORY_REGION (flags)",
        }
    }
}

/// A warning when `r`'s host and guest addresses differ modulo its huge-page size.
pub fn congruence_warning(r: &Region) -> Option<String> {
    let align = r.huge_align();
    let (host, guest) = (r.host_addr() as u64, r.guest_addr().0);
    (align > 1 && host % align != guest % align).then(|| {
        format!(
            "region at {guest:#x}: host address {host:#x} is not congruent to it modulo {align:#x}; KVM cannot map it with huge pages"
        )
    })
}
