//! A mapped region: host memory placed by [`crate::layout`], owned until the last handle goes.
//!
//! Mapping is all-or-nothing: any failure after the reservation unmaps it and closes the
//! descriptor before the error is returned, so bad input leaves nothing behind.

use std::ffi::CString;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, BorrowedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

use vm_memory::{FileOffset, GuestAddress};

use crate::layout::{Access, Backing, Guard, HugePageSize, Placement, RegionSpec, Reserve, Thp};
use crate::sys::{self, MmapRange};

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
    /// The region's guest range runs past the end of the 64-bit address space.
    #[error("region at {addr:#x} size {size:#x}: guest range overflows u64")]
    Overflow {
        /// Guest address of the region.
        addr: u64,
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
    /// The kernel has no hugetlb pool of this page size.
    #[error("region at {addr:#x}: this kernel has no {size} hugetlb pages ({dir} missing)")]
    HugetlbUnsupported {
        /// Guest address of the region.
        addr: u64,
        /// The page size asked for.
        size: HugePageSize,
        /// The sysfs directory that is missing.
        dir: String,
    },
    /// Too few free hugetlb pages for the region.
    #[error("region at {addr:#x}: needs {needed} free {size} hugetlb pages, pool has {available} (raise {dir}/nr_hugepages)")]
    HugetlbPoolTooSmall {
        /// Guest address of the region.
        addr: u64,
        /// The page size asked for.
        size: HugePageSize,
        /// Pages the region needs.
        needed: u64,
        /// Free, unreserved pages in the pool.
        available: u64,
        /// The pool's sysfs directory.
        dir: String,
    },
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
    /// The NUMA node does not exist.
    #[error("region at {addr:#x}: NUMA node {node} does not exist on this host")]
    NoSuchNumaNode {
        /// Guest address of the region.
        addr: u64,
        /// The node asked for.
        node: u32,
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
#[derive(Debug)]
pub struct Region {
    id: u64,
    guest_addr: GuestAddress,
    size: u64,
    host: usize,
    reservation: MmapRange,
    backing: Backing,
    page_size: u64,
    huge_align: u64,
    thp: Thp,
    guard: Guard,
    access: Access,
    reserve: Reserve,
    numa_node: Option<u32>,
    file: Option<FileOffset>,
    warnings: Vec<String>,
}

/// Unmaps a reservation on early return.
struct ReservationGuard(Option<MmapRange>);

impl Drop for ReservationGuard {
    fn drop(&mut self) {
        if let Some(r) = self.0.take() {
            // An munmap of a range we reserved cannot fail in a way we could act on here.
            let _ = sys::munmap(r);
        }
    }
}

/// Free, unreserved pages in a hugetlb pool, or `None` if the pool does not exist.
pub fn hugetlb_available(size: HugePageSize) -> Option<u64> {
    let dir = size.sysfs_dir();
    let read = |f: &str| -> Option<u64> {
        std::fs::read_to_string(format!("{dir}/{f}"))
            .ok()?
            .trim()
            .parse()
            .ok()
    };
    let free = read("free_hugepages")?;
    let resv = read("resv_hugepages").unwrap_or(0);
    Some(free.saturating_sub(resv))
}

impl Region {
    /// Maps the region that `spec` describes.
    pub fn map(spec: &RegionSpec) -> Result<Region, RegionError> {
        let addr = spec.guest_addr.0;
        let size = spec.size;
        let sys_err = |op: &'static str, source: io::Error| RegionError::Syscall {
            addr,
            size,
            op,
            source,
        };
        if size == 0 {
            return Err(RegionError::ZeroSize { addr });
        }
        let page = spec.page_size();
        if size % page != 0 || addr % page != 0 {
            return Err(RegionError::Unaligned { addr, size, page });
        }
        if spec.guest_end().is_none() {
            return Err(RegionError::Overflow { addr, size });
        }
        let huge_align = spec.huge_align();
        let guard = match spec.guard {
            Guard::On => crate::layout::GUARD_BYTES,
            Guard::Off => 0,
        };
        let plan = Placement::plan(size, huge_align, guard)
            .filter(|p| usize::try_from(p.reserve_len).is_ok())
            .ok_or(RegionError::TooLarge { addr, size })?;
        if let Some(node) = spec.numa_node {
            if !std::path::Path::new(&format!("/sys/devices/system/node/node{node}")).exists() {
                return Err(RegionError::NoSuchNumaNode { addr, node });
            }
        }

        // The backing object, and how to map it.
        let prot = libc::PROT_READ | libc::PROT_WRITE;
        let (file, flags): (Option<FileOffset>, libc::c_int) = match &spec.backing {
            Backing::Anonymous => (None, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS),
            Backing::Memfd => {
                let name = CString::new(format!("guestmem@{addr:#x}")).expect("no NUL");
                let fd = sys::memfd_create(&name, 0).map_err(|e| sys_err("memfd_create", e))?;
                let f = File::from(fd);
                f.set_len(size).map_err(|e| sys_err("ftruncate", e))?;
                (Some(FileOffset::new(f, 0)), libc::MAP_SHARED)
            }
            Backing::Hugetlb(h) => {
                let dir = h.sysfs_dir();
                let available = hugetlb_available(*h).ok_or(RegionError::HugetlbUnsupported {
                    addr,
                    size: *h,
                    dir: dir.clone(),
                })?;
                let needed = size / h.bytes();
                let mut flags = libc::MAP_SHARED;
                match spec.reserve {
                    Reserve::Reserve if needed > available => {
                        return Err(RegionError::HugetlbPoolTooSmall {
                            addr,
                            size: *h,
                            needed,
                            available,
                            dir,
                        })
                    }
                    Reserve::Reserve => {}
                    Reserve::NoReserve => flags |= libc::MAP_NORESERVE,
                }
                let name = CString::new(format!("guestmem-huge@{addr:#x}")).expect("no NUL");
                let fd = sys::memfd_create(&name, libc::MFD_HUGETLB | h.shift_bits())
                    .map_err(|e| sys_err("memfd_create(MFD_HUGETLB)", e))?;
                let f = File::from(fd);
                f.set_len(size).map_err(|e| sys_err("ftruncate", e))?;
                (Some(FileOffset::new(f, 0)), flags)
            }
            Backing::File { path, offset } => {
                if offset % sys::base_page_size() != 0 {
                    return Err(RegionError::Unaligned {
                        addr,
                        size: *offset,
                        page: sys::base_page_size(),
                    });
                }
                let file_err = |source| RegionError::File {
                    addr,
                    path: path.clone(),
                    source,
                };
                // A read-only region may come from a read-only file (a firmware image): map
                // it private, so host writes (image loading) stay in this process.
                let (f, flags) = match OpenOptions::new().read(true).write(true).open(path) {
                    Ok(f) => (f, libc::MAP_SHARED),
                    Err(e)
                        if spec.access == Access::ReadOnly
                            && e.kind() == io::ErrorKind::PermissionDenied =>
                    {
                        (File::open(path).map_err(file_err)?, libc::MAP_PRIVATE)
                    }
                    Err(e) => return Err(file_err(e)),
                };
                let file_len = f.metadata().map_err(file_err)?.len();
                let needed = offset
                    .checked_add(size)
                    .ok_or(RegionError::Overflow { addr, size })?;
                if file_len < needed {
                    return Err(RegionError::FileTooShort {
                        addr,
                        path: path.clone(),
                        file_len,
                        needed,
                    });
                }
                (Some(FileOffset::new(f, *offset)), flags)
            }
        };

        let res = sys::reserve(plan.reserve_len as usize).map_err(|e| sys_err("mmap", e))?;
        let mut res_guard = ReservationGuard(Some(res));
        let res_start = res.addr() as u64;
        let host = plan.host_start(res_start, addr, huge_align);
        let head = (host - guard - res_start) as usize;
        let body = res
            .sub(head + guard as usize, size as usize)
            .expect("placement fits the reservation");
        sys::map_fixed(
            body,
            prot,
            flags,
            file.as_ref().map(|f| f.file().as_fd()),
            file.as_ref().map_or(0, |f| f.start()),
        )
        .map_err(|e| sys_err("mmap(MAP_FIXED)", e))?;

        // Give back the slack on either side, keeping the guards.
        let keep_len = size as usize + 2 * guard as usize;
        let tail = head + keep_len;
        sys::munmap(res.sub(0, head).expect("head inside reservation"))
            .map_err(|e| sys_err("munmap", e))?;
        sys::munmap(
            res.sub(tail, res.len() - tail)
                .expect("tail inside reservation"),
        )
        .map_err(|e| sys_err("munmap", e))?;
        let kept = res
            .sub(head, keep_len)
            .expect("kept range inside reservation");
        res_guard.0 = Some(kept);

        let mut warnings = Vec::new();
        let thp_capable = matches!(spec.backing, Backing::Anonymous | Backing::Memfd);
        if thp_capable {
            let advice = match spec.thp {
                Thp::Huge => Some(libc::MADV_HUGEPAGE),
                Thp::NoHuge => Some(libc::MADV_NOHUGEPAGE),
                Thp::Default => None,
            };
            if let Some(advice) = advice {
                // A hint: the kernel may lack THP; the region still works with small pages.
                if let Err(e) = sys::madvise(body, advice) {
                    warnings.push(format!(
                        "region at {addr:#x}: THP advice failed ({e}); it will use small pages"
                    ));
                }
            }
        }
        if let Some(node) = spec.numa_node {
            sys::mbind_node(body, node).map_err(|e| sys_err("mbind", e))?;
        }

        res_guard.0 = None;
        Ok(Region {
            id: NEXT_REGION_ID.fetch_add(1, Ordering::Relaxed),
            guest_addr: spec.guest_addr,
            size,
            host: host as usize,
            reservation: kept,
            backing: spec.backing.clone(),
            page_size: page,
            huge_align,
            thp: spec.thp,
            guard: spec.guard,
            access: spec.access,
            reserve: spec.reserve,
            numa_node: spec.numa_node,
            file,
            warnings,
        })
    }

    /// A process-unique id, never reused.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The guest address of the first byte.
    pub fn guest_addr(&self) -> GuestAddress {
        self.guest_addr
    }

    /// The guest address one past the last byte.
    pub fn guest_end(&self) -> u64 {
        self.guest_addr.0 + self.size
    }

    /// The size in bytes.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The host address of the first byte.
    pub fn host_addr(&self) -> *mut u8 {
        self.host as *mut u8
    }

    /// The host address range of the region's memory (guards excluded).
    pub fn host_range(&self) -> MmapRange {
        // SAFETY: `host..host+size` is the mapping this region owns, made in `map`; its
        // length fit in usize there.
        unsafe { MmapRange::new(self.host, self.size as usize) }.expect("checked at map time")
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
    /// pages outlive an `MADV_DONTNEED` until a hole is punched.
    pub fn is_shared(&self) -> bool {
        self.file.is_some()
    }

    /// The backing descriptor and offset, for sharing (vhost-user) or KVM.
    pub fn file_offset(&self) -> Option<&FileOffset> {
        self.file.as_ref()
    }

    /// The backing descriptor.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.file.as_ref().map(|f| f.file().as_fd())
    }

    /// Hints that failed while mapping (e.g. THP advice), for the caller to report.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Whether `addr..addr+len` lies inside the region (false on overflow).
    pub fn contains_range(&self, addr: u64, len: u64) -> bool {
        addr >= self.guest_addr.0
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= self.guest_end())
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        // The reservation covers the region and its guards; nothing borrows it once the last
        // handle is gone. A failing munmap here could only leak address space.
        let _ = sys::munmap(self.reservation);
    }
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
        assert_eq!(r.host as u64 % (2 << 20), r.guest_addr().0 % (2 << 20));
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
            matches!(e, RegionError::NoSuchNumaNode { node: 4000, .. }),
            "{e}"
        );
    }
}
