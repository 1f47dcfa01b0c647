//! A mapped region: host memory placed by [`crate::layout`], owned until the last handle goes.
//!
//! [`Region::map`] runs four named steps: check the spec against itself and the host
//! ([`RegionSpec`] rules, then [`Host::check`] at [`Stage::Map`]), open the backing object,
//! place the mapping inside a reservation so its host address is congruent to its guest
//! address, and give the advice. Mapping is all-or-nothing: every step owns what it made
//! ([`Reservation`], [`Mapping`], the backing `File`), so a failure drops them and bad input
//! leaves nothing behind.
//!
//! **Backing files and `SIGBUS`.** A mapping of a file that shrinks under it raises `SIGBUS`
//! on any access past the new end, which no Rust code can recover from. So:
//! - memfds guestmem creates (memfd and hugetlb backings) are sealed against shrinking and
//!   growing (`F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`) before they are mapped: nothing
//!   holding the descriptor, this process or a vhost-user peer it was shared with, can change
//!   their size, and `ftruncate` fails with `EPERM`;
//! - a file the caller provides ([`Backing::File`]) is checked at map time to hold the whole
//!   region. Its length stays the caller's responsibility: if anyone truncates it later,
//!   touching the lost part through this region kills the process with `SIGBUS`, as it would
//!   in any VMM. [`Region::check_backing`] re-checks the length on demand, and populate
//!   names a short file instead of a bare `EFAULT`.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vm_memory::{FileOffset, GuestAddress};

mod backing;

use crate::dirty::{DirtyBitmap, DIRTY_PAGE_BYTES};
use crate::host::{Demand, Host, HostError, Stage};
use crate::layout::{Access, Backing, DirtyTracking, Guard, Placement, RegionSpec, Reserve, Thp};
use crate::mmap::{Advice, MapSource, Mapping, MmapError, Reservation};
use crate::sys;

/// Why a region could not be mapped. Every variant names the region by its guest address.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The size is zero.
    #[error("region at {addr:#x}: size is zero")]
    ZeroSize {
        /// Guest address of the region.
        addr: u64,
    },
    /// The size or guest address is not a multiple of the region's page size.
    #[error("region at {addr:#x} size {size:#x}: address and size must be multiples of the {page:#x}-byte page size of its backing")]
    Unaligned {
        /// Guest address of the region.
        addr: u64,
        /// Size of the region.
        size: u64,
        /// The page size they must be multiples of.
        page: u64,
    },
    /// The backing file offset is not a multiple of the base page size.
    #[error("region at {addr:#x}: file offset {offset:#x} is not a multiple of the {page:#x}-byte page size")]
    UnalignedFileOffset {
        /// Guest address of the region.
        addr: u64,
        /// The file offset asked for.
        offset: u64,
        /// The page size it must be a multiple of.
        page: u64,
    },
    /// The region's guest range runs past the end of the 64-bit address space.
    #[error("region at {addr:#x} size {size:#x}: guest range overflows u64")]
    Overflow {
        /// Guest address of the region.
        addr: u64,
        /// Size of the region.
        size: u64,
    },
    /// The region's file range (offset + size) runs past the largest file offset.
    #[error("region at {addr:#x} size {size:#x}: file offset {offset:#x} + size overflows the largest file offset")]
    FileRangeOverflow {
        /// Guest address of the region.
        addr: u64,
        /// The file offset.
        offset: u64,
        /// Size of the region.
        size: u64,
    },
    /// The region does not fit in this host's address space.
    #[error("region at {addr:#x} size {size:#x}: too large for the host address space")]
    TooLarge {
        /// Guest address of the region.
        addr: u64,
        /// Size of the region.
        size: u64,
    },
    /// The host cannot give what the region needs (hugetlb pool, NUMA node, mappings).
    #[error(transparent)]
    Host(#[from] HostError),
    /// The backing file could not be opened or sized.
    #[error("region at {addr:#x}: backing file {path}: {source}")]
    File {
        /// Guest address of the region.
        addr: u64,
        /// The file.
        path: PathBuf,
        /// What went wrong.
        source: io::Error,
    },
    /// The backing file is shorter than `offset + size`.
    #[error("region at {addr:#x}: backing file {path} holds {file_len:#x} bytes, region needs {needed:#x} (offset + size)")]
    FileTooShort {
        /// Guest address of the region.
        addr: u64,
        /// The file.
        path: PathBuf,
        /// The file's length.
        file_len: u64,
        /// Bytes the region needs.
        needed: u64,
    },
    /// A syscall failed.
    #[error("region at {addr:#x} size {size:#x}: {op} failed: {source}")]
    Syscall {
        /// Guest address of the region.
        addr: u64,
        /// Size of the region.
        size: u64,
        /// The operation.
        op: &'static str,
        /// The errno.
        source: io::Error,
    },
}

static NEXT_REGION_ID: AtomicU64 = AtomicU64::new(1);

/// Guest memory backed by one host mapping.
///
/// A region is shared through `Arc<Region>`; its mapping is removed when the last one drops.
/// It hands out its host address as a raw pointer and its memory as volatile slices (through
/// vm-memory's traits), never anything that could unmap or remap it.
#[derive(Debug)]
pub struct Region {
    id: u64,
    guest_addr: GuestAddress,
    size: u64,
    mapping: Mapping,
    backing: Backing,
    page_size: u64,
    huge_align: u64,
    thp: Thp,
    guard: Guard,
    access: Access,
    reserve: Reserve,
    numa_node: Option<u32>,
    file: Option<FileOffset>,
    /// Whether `file` is mapped shared (its pages are the guest's memory), not private.
    shared: bool,
    dirty: Option<DirtyBitmap>,
    warnings: Vec<String>,
    /// Snapshot bookkeeping: whether a lazy restore is filling the region, and which save
    /// its dirty bitmap counts from.
    pub(crate) lifecycle: crate::lifecycle::Lifecycle,
}

/// A spec that passed its checks, with the numbers mapping needs.
struct Checked {
    addr: u64,
    size: u64,
    len: usize,
    page: u64,
    huge_align: u64,
    guard: u64,
    placement: Placement,
}

/// The object behind a region's memory, opened and sized, and how to map it.
struct Opened {
    file: Option<FileOffset>,
    shared: bool,
}

impl Region {
    /// Maps the region that `spec` describes, after checking what it needs against the host.
    pub fn map(spec: &RegionSpec) -> Result<Region, RegionError> {
        let host = Host::read();
        let c = check_spec(spec, host.page_size)?;
        host.check(&[Demand::of_spec(spec)], Stage::Map)?;
        Region::map_checked(spec, c)
    }

    /// Maps the region that `spec` describes, whose host needs the caller has checked
    /// together with those of the regions mapped beside it (`GuestMap::from_specs`).
    pub(crate) fn map_on(spec: &RegionSpec, host: &Host) -> Result<Region, RegionError> {
        Region::map_checked(spec, check_spec(spec, host.page_size)?)
    }

    fn map_checked(spec: &RegionSpec, c: Checked) -> Result<Region, RegionError> {
        let opened = open_backing(spec, &c)?;
        let mapping = place(spec, &c, &opened)?;
        let warnings = advise(spec, &c, &mapping)?;
        let dirty = match spec.dirty {
            DirtyTracking::Off => None,
            DirtyTracking::On => Some(DirtyBitmap::new(c.size, DIRTY_PAGE_BYTES).map_err(|e| {
                RegionError::Syscall {
                    addr: c.addr,
                    size: c.size,
                    op: "dirty bitmap",
                    source: io::Error::other(e),
                }
            })?),
        };
        Ok(Region {
            id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
            guest_addr: spec.guest_addr,
            size: c.size,
            mapping,
            backing: spec.backing.clone(),
            page_size: c.page,
            huge_align: c.huge_align,
            thp: spec.thp,
            guard: spec.guard,
            access: spec.access,
            reserve: spec.reserve,
            numa_node: spec.numa_node,
            file: opened.file,
            shared: opened.shared,
            dirty,
            warnings,
            lifecycle: Default::default(),
        })
    }

    /// A process-unique id, never reused.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The guest address of the first byte.
    #[inline]
    pub fn guest_addr(&self) -> GuestAddress {
        self.guest_addr
    }

    /// The guest address one past the last byte.
    pub fn guest_end(&self) -> u64 {
        self.guest_addr.0 + self.size
    }

    /// The size in bytes.
    #[inline]
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The host address of the first byte.
    #[inline]
    pub fn host_addr(&self) -> *mut u8 {
        self.mapping.as_ptr()
    }

    /// The mapping, for guestmem's own range operations (populate, pin, release).
    pub(crate) fn mapping(&self) -> &Mapping {
        &self.mapping
    }

    /// The backing.
    pub fn backing(&self) -> &Backing {
        &self.backing
    }

    /// The page size of the backing: the hugetlb size, or the base page size.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The alignment the host and guest addresses share.
    pub fn huge_align(&self) -> u64 {
        self.huge_align
    }

    /// The THP advice given.
    pub fn thp(&self) -> Thp {
        self.thp
    }

    /// Whether guard pages surround the region.
    pub fn guard(&self) -> Guard {
        self.guard
    }

    /// Who may write the region.
    pub fn access(&self) -> Access {
        self.access
    }

    /// How hugetlb pages were reserved (meaningful for hugetlb backings only): a
    /// [`Reserve::NoReserve`] region takes its pages when first touched, so populating it can
    /// run the pool dry part-way.
    pub fn reserve(&self) -> Reserve {
        self.reserve
    }

    /// The NUMA node the region is bound to.
    pub fn numa_node(&self) -> Option<u32> {
        self.numa_node
    }

    /// Whether the backing is hugetlb.
    pub fn is_hugetlb(&self) -> bool {
        matches!(self.backing, Backing::Hugetlb(_))
    }

    /// Whether the backing is shared memory (memfd, hugetlb memfd or a shared file), whose
    /// pages outlive an `MADV_DONTNEED` until a hole is punched, and whose descriptor
    /// ([`Region::file_offset`]) reaches the guest's memory itself. A file mapped private
    /// is not: its descriptor reaches the file, not the guest's copy of it.
    pub fn is_shared(&self) -> bool {
        self.file.is_some() && self.shared
    }

    /// The backing descriptor and offset, for sharing (vhost-user) or KVM.
    pub fn file_offset(&self) -> Option<&FileOffset> {
        self.file.as_ref()
    }

    /// The backing descriptor.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.file().as_fd())
    }

    /// The bitmap that records which 4 KiB pages were written through vm-memory (and, with
    /// KVM, by the guest once harvested), if the region tracks writes
    /// ([`crate::layout::DirtyTracking`]).
    pub fn dirty_bitmap(&self) -> Option<&DirtyBitmap> {
        self.dirty.as_ref()
    }

    #[inline]
    pub(crate) fn dirty_option(&self) -> &Option<DirtyBitmap> {
        &self.dirty
    }

    /// Whether a restore is filling the region, or failed to ([`crate::restore`]).
    pub fn restore_state(&self) -> crate::lifecycle::RestoreState {
        self.lifecycle.restore.get()
    }

    /// Hints that failed while mapping (e.g. THP advice), for the caller to report.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether the backing still holds the whole region: for [`Backing::File`], that the
    /// file is at least `offset + size` bytes long (someone may have truncated it since it was
    /// mapped); other backings cannot shrink (memfds are sealed), so they always pass.
    pub fn check_backing(&self) -> Result<(), RegionError> {
        let (Backing::File { path, .. } | Backing::FilePrivate { path, .. }, Some(fo)) =
            (&self.backing, &self.file)
        else {
            return Ok(());
        };
        let needed = fo.start() + self.size;
        let file_len = fo
            .file()
            .metadata()
            .map_err(|source| RegionError::File {
                addr: self.guest_addr.0,
                path: path.clone(),
                source,
            })?
            .len();
        if file_len < needed {
            return Err(RegionError::FileTooShort {
                addr: self.guest_addr.0,
                path: path.clone(),
                file_len,
                needed,
            });
        }
        Ok(())
    }

    /// Whether `addr..addr+len` lies inside the region (false on overflow).
    pub fn contains_range(&self, addr: u64, len: u64) -> bool {
        addr >= self.guest_addr.0
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.guest_end())
    }
}

fn sys_err<'a>(c: &'a Checked, op: &'static str) -> impl FnOnce(io::Error) -> RegionError + 'a {
    move |source| RegionError::Syscall {
        addr: c.addr,
        size: c.size,
        op,
        source,
    }
}

fn mmap_err(c: &Checked) -> impl Fn(MmapError) -> RegionError + '_ {
    move |e| RegionError::Syscall {
        addr: c.addr,
        size: c.size,
        op: e.op(),
        source: e.into_io(),
    }
}

/// Step 1: the spec's own rules (size, alignment, overflow, file offset) before anything is
/// created; what the host must give it is checked by the caller ([`Region::map`] alone,
/// `GuestMap::from_specs` for all regions together).
fn check_spec(spec: &RegionSpec, base_page: u64) -> Result<Checked, RegionError> {
    let addr = spec.guest_addr.0;
    let size = spec.size;
    if size == 0 {
        return Err(RegionError::ZeroSize { addr });
    }
    let page = spec.page_size();
    if !size.is_multiple_of(page) || !addr.is_multiple_of(page) {
        return Err(RegionError::Unaligned { addr, size, page });
    }
    if spec.guest_end().is_none() {
        return Err(RegionError::Overflow { addr, size });
    }
    if let Backing::File { offset, .. } | Backing::FilePrivate { offset, .. } = &spec.backing {
        let base = base_page;
        if offset % base != 0 {
            return Err(RegionError::UnalignedFileOffset {
                addr,
                offset: *offset,
                page: base,
            });
        }
        let fits = offset
            .checked_add(size)
            .is_some_and(|end| i64::try_from(end).is_ok());
        if !fits {
            return Err(RegionError::FileRangeOverflow {
                addr,
                offset: *offset,
                size,
            });
        }
    }
    let huge_align = spec.huge_align();
    let guard = match spec.guard {
        Guard::On => crate::layout::GUARD_BYTES,
        Guard::Off => 0,
    };
    let too_large = RegionError::TooLarge { addr, size };
    let placement = Placement::plan(size, huge_align, guard)
        .filter(|p| usize::try_from(p.reserve_len).is_ok())
        .ok_or(too_large)?;
    Ok(Checked {
        addr,
        size,
        len: size as usize, // fits: reserve_len >= size fits usize
        page,
        huge_align,
        guard,
        placement,
    })
}

/// Step 2: the backing object, opened and sized. Memfds are sealed against resizing before
/// they are mapped; a caller's file is checked to hold the whole region.
fn open_backing(spec: &RegionSpec, c: &Checked) -> Result<Opened, RegionError> {
    let memfd = |name: String, flags| -> Result<Opened, RegionError> {
        let name = CString::new(name).expect("no NUL in a formatted address");
        let fd = sys::memfd_create(&name, flags).map_err(sys_err(c, "memfd_create"))?;
        let f = File::from(fd);
        f.set_len(c.size).map_err(sys_err(c, "ftruncate"))?;
        sys::seal_size(f.as_fd()).map_err(sys_err(c, "fcntl(F_ADD_SEALS)"))?;
        Ok(Opened {
            file: Some(FileOffset::new(f, 0)),
            shared: true,
        })
    };
    match &spec.backing {
        Backing::Anonymous => Ok(Opened {
            file: None,
            shared: false,
        }),
        Backing::Memfd => memfd(format!("guestmem@{:#x}", c.addr), 0),
        Backing::Hugetlb(h) => memfd(
            format!("guestmem-huge@{:#x}", c.addr),
            libc::MFD_HUGETLB | h.shift_bits(),
        ),
        Backing::File { path, offset } | Backing::FilePrivate { path, offset } => {
            let private = matches!(spec.backing, Backing::FilePrivate { .. });
            let file_err = |source| RegionError::File {
                addr: c.addr,
                path: path.clone(),
                source,
            };
            let (f, shared) =
                backing::open(path, !private, spec.access == Access::ReadOnly).map_err(file_err)?;
            let meta = f.metadata().map_err(file_err)?;
            let file_len = meta.len();
            let needed = offset + c.size; // checked in check_spec
            if file_len < needed {
                return Err(RegionError::FileTooShort {
                    addr: c.addr,
                    path: path.clone(),
                    file_len,
                    needed,
                });
            }
            Ok(Opened {
                file: Some(FileOffset::new(f, *offset)),
                shared,
            })
        }
    }
}

/// Step 3: a reservation with room to align, trimmed to the region and its guards, and the
/// backing placed inside it with the host address congruent to the guest address modulo the
/// huge-page size.
fn place(spec: &RegionSpec, c: &Checked, opened: &Opened) -> Result<Mapping, RegionError> {
    let res_len = c.placement.reserve_len as usize;
    let res = Reservation::new(res_len).map_err(mmap_err(c))?;
    let res_start = res.addr() as u64;
    let host = c.placement.host_start(res_start, c.addr, c.huge_align);
    let head = (host - c.guard - res_start) as usize;
    let keep_len = c.len + 2 * c.guard as usize;
    let res = res.trim(head, keep_len).map_err(mmap_err(c))?;
    let source = match &opened.file {
        None => return res.place(c.guard as usize, c.len).map_err(mmap_err(c)),
        Some(f) if opened.shared => MapSource::SharedFile {
            fd: f.file().as_fd(),
            offset: f.start(),
        },
        Some(f) => MapSource::PrivateFile {
            fd: f.file().as_fd(),
            offset: f.start(),
        },
    };
    // The reserve mode matters for hugetlb only; every other backing maps as reserved.
    let reserve = match spec.backing {
        Backing::Hugetlb(_) => spec.reserve,
        _ => Reserve::Reserve,
    };
    // Every page stays backed while the region lives: memfds are sized and sealed
    // (open_backing); a caller's file was checked, and keeping it is their contract
    // (`Backing::File`); `NoReserve` needs the `unsafe` `RegionSpec::with_reserve` promise.
    // SAFETY: the backing holds every page of the mapping for its life (just above).
    unsafe { res.place_file(c.guard as usize, c.len, source, reserve) }.map_err(mmap_err(c))
}

/// Step 4: THP advice (a hint: a failure is a warning) and the NUMA binding (a requirement).
fn advise(spec: &RegionSpec, c: &Checked, m: &Mapping) -> Result<Vec<String>, RegionError> {
    let mut warnings = Vec::new();
    if matches!(spec.backing, Backing::Anonymous | Backing::Memfd) {
        let advice = match spec.thp {
            Thp::Huge => Some(Advice::HugePage),
            Thp::NoHuge => Some(Advice::NoHugePage),
            Thp::Default => None,
        };
        if let Some(advice) = advice {
            // A hint: the kernel may lack THP; the region still works with small pages.
            if let Err(e) = m.advise(0, c.len, advice) {
                warnings.push(format!(
                    "region at {:#x}: THP advice failed ({e}); it will use small pages",
                    c.addr
                ));
            }
        }
    }
    if let Some(node) = spec.numa_node {
        m.bind_node(0, c.len, node).map_err(mmap_err(c))?;
    }
    Ok(warnings)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_zero_size_is_refused() {
        let e = Region::map(&RegionSpec::new(GuestAddress(0x1000), 0)).unwrap_err();
        assert!(matches!(e, RegionError::ZeroSize { addr: 0x1000 }), "{e}");
    }

    #[test]
    fn map_unaligned_size_names_region_and_page() {
        let e = Region::map(&RegionSpec::new(GuestAddress(0x2000), 0x1001)).unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("0x2000") && msg.contains("0x1000"), "{msg}");
    }

    #[test]
    fn map_overflowing_range_is_refused() {
        let e = Region::map(&RegionSpec::new(GuestAddress(u64::MAX - 0xfff), 0x2000)).unwrap_err();
        assert!(matches!(e, RegionError::Overflow { .. }), "{e}");
    }

    #[test]
    fn map_places_host_congruent_to_guest_and_writes_read_back() {
        let spec = RegionSpec::new(GuestAddress(0x4020_0000 + 0x3000), 8 << 20);
        let r = Region::map(&spec).unwrap();
        assert_eq!(
            r.host_addr() as u64 % (2 << 20),
            r.guest_addr().0 % (2 << 20)
        );
        // SAFETY: the region maps `size` writable bytes at host_addr, and no one else uses it.
        let s = unsafe { std::slice::from_raw_parts_mut(r.host_addr(), r.size() as usize) };
        s[0] = 0xa5;
        s[s.len() - 1] = 0x5a;
        assert_eq!((s[0], s[s.len() - 1]), (0xa5, 0x5a));
    }

    #[test]
    fn map_file_shorter_than_region_is_refused() {
        let dir = std::env::temp_dir().join(format!("guestmem-short-{}", std::process::id()));
        std::fs::write(&dir, vec![0u8; 8192]).unwrap();
        let spec = RegionSpec::new(GuestAddress(0), 0x4000).with_backing(Backing::File {
            path: dir.clone(),
            offset: 4096,
        });
        let e = Region::map(&spec).unwrap_err();
        std::fs::remove_file(&dir).unwrap();
        assert!(
            matches!(
                e,
                RegionError::FileTooShort {
                    file_len: 8192,
                    needed: 0x5000,
                    ..
                }
            ),
            "{e}"
        );
    }

    #[test]
    fn map_missing_numa_node_is_refused() {
        let spec = RegionSpec::new(GuestAddress(0), 0x1000).with_numa_node(4000);
        let e = Region::map(&spec).unwrap_err();
        assert!(
            matches!(
                e,
                RegionError::Host(HostError::NoSuchNumaNode { node: 4000, .. })
            ),
            "{e}"
        );
    }
}
