//! Facts about this host, read once, and the one computation of what a set of regions needs
//! from it.
//!
//! Design choice: every sysfs and procfs fact guestmem acts on is read here, by
//! [`Host::read`], and nowhere else: hugetlb pools and their free pages, NUMA nodes and their
//! CPUs, `MemAvailable`, the memory cgroup's limit and usage (v1 or v2), `CapEff`, `VmLck`,
//! `RLIMIT_MEMLOCK`, the THP mode and `vm.max_map_count` with the process's current mapping
//! count. A caller reads them once per operation, so mapping 8,000 regions costs one read of
//! each file rather than 8,000, and every refusal quotes the very numbers it was decided on.
//!
//! What a set of regions needs is computed by one function, [`Host::check`], from one
//! [`Demand`] per region, at one of two [`Stage`]s:
//! - [`Stage::Map`]: what `mmap` itself takes: reserved hugetlb pages (a pool too small
//!   fails the map part-way with a bare `ENOMEM`) and mappings (`vm.max_map_count`).
//! - [`Stage::Populate`]: what faulting the memory in takes: ordinary memory not yet resident
//!   (against `MemAvailable` and the memory cgroup's headroom), pages of `MAP_NORESERVE`
//!   hugetlb regions not yet resident, and locked memory when pinning.
//!
//! Hugetlb regions are never counted as ordinary memory or as locked memory: their pages come
//! from their own pool, cannot be swapped, and the kernel ignores `mlock` on them.

use std::path::{Path, PathBuf};

use crate::layout::{Backing, HugePageSize, RegionSpec, Reserve};

mod cgroup;
pub(crate) mod read;

use cgroup::{read_hugetlb_cgroups, read_memory_cgroup};
use read::{meminfo_bytes, parse_cap_eff, read_nodes, read_pool, read_thp_word};
pub(crate) use read::{numa_nodes, read_u64};

/// Capability number of `CAP_IPC_LOCK` (linux/capability.h).
pub const CAP_IPC_LOCK: u32 = 14;

/// Where sysfs keeps the NUMA nodes.
const NODE_SYSFS: &str = "/sys/devices/system/node";

/// Why a set of regions does not fit this host. Each variant quotes the numbers it was
/// decided on and, where one region is at fault, names it by guest address.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HostError {
    /// The kernel has no hugetlb pool of this page size.
    #[error("region at {addr:#x}: this kernel has no {size} hugetlb pages ({dir} missing)")]
    HugetlbUnsupported {
        /// Guest address of the first region that asks for the pool.
        addr: u64,
        /// The page size asked for.
        size: HugePageSize,
        /// The sysfs directory that is missing.
        dir: String,
    },
    /// A hugetlb pool holds fewer free pages than the regions need.
    #[error("region at {addr:#x}: needs {needed} free {size} hugetlb pages (with the regions before it), pool has {available} (raise {dir}/nr_hugepages)")]
    HugetlbPool {
        /// Guest address of the first region that does not fit.
        addr: u64,
        /// The page size.
        size: HugePageSize,
        /// Pages needed by the regions up to and including it.
        needed: u64,
        /// Free, unreserved pages in the pool.
        available: u64,
        /// The pool's sysfs directory.
        dir: String,
    },
    /// A region asks for a NUMA node this host does not have.
    #[error("region at {addr:#x}: NUMA node {node} does not exist on this host")]
    NoSuchNumaNode {
        /// Guest address of the region.
        addr: u64,
        /// The node asked for.
        node: u32,
    },
    /// The regions need more ordinary memory than the host has available.
    #[error("layout needs {needed} bytes ({:.2} GiB) of memory not yet resident, but the host has {available} bytes ({:.2} GiB) available (MemAvailable)", gib(*needed), gib(*available))]
    Memory {
        /// Bytes needed.
        needed: u64,
        /// `MemAvailable`.
        available: u64,
    },
    /// The regions need more memory than the process's memory cgroup allows.
    #[error("layout needs {needed} bytes ({:.2} GiB) of memory not yet resident, but memory cgroup {} allows {limit} bytes and already uses {usage} ({:.2} GiB left)", gib(*needed), path.display(), gib(limit.saturating_sub(*usage)))]
    Cgroup {
        /// Bytes needed.
        needed: u64,
        /// The cgroup's directory.
        path: PathBuf,
        /// Its limit in bytes.
        limit: u64,
        /// Its usage in bytes.
        usage: u64,
    },
    /// The regions need more hugetlb pages than the process's hugetlb cgroup allows: a page
    /// faulted in past its limit raises `SIGBUS`.
    #[error("layout needs {needed} bytes of {size} hugetlb pages not yet resident, but hugetlb cgroup {} allows {limit} bytes of them and already uses {usage}", path.display())]
    HugetlbCgroup {
        /// The page size.
        size: HugePageSize,
        /// Bytes needed.
        needed: u64,
        /// The cgroup's directory.
        path: PathBuf,
        /// Its limit for this page size, in bytes.
        limit: u64,
        /// Its usage for this page size, in bytes.
        usage: u64,
    },
    /// Pinning would exceed `RLIMIT_MEMLOCK`.
    #[error("pinning needs {needed} bytes of locked memory (already locked included), RLIMIT_MEMLOCK is {limit} bytes; raise it (ulimit -l) or grant CAP_IPC_LOCK")]
    Memlock {
        /// Bytes that would be locked after the request.
        needed: u64,
        /// The soft limit.
        limit: u64,
    },
    /// The regions would take the process past `vm.max_map_count` mappings.
    #[error("layout needs {needed} more mappings, the process has {current} and vm.max_map_count is {limit} (raise /proc/sys/vm/max_map_count, or use fewer regions or no guards)")]
    MapCount {
        /// Mappings the regions add.
        needed: u64,
        /// Mappings the process has now.
        current: u64,
        /// `vm.max_map_count`.
        limit: u64,
    },
}

fn gib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 30) as f64
}

/// One hugetlb pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct HugetlbPool {
    /// Its page size.
    pub size: HugePageSize,
    /// `nr_hugepages`.
    pub total: u64,
    /// `free_hugepages`.
    pub free: u64,
    /// `resv_hugepages`: free pages already promised to mappings.
    pub reserved: u64,
}

impl HugetlbPool {
    /// Free pages no mapping has reserved: what a new mapping can take.
    pub fn available(&self) -> u64 {
        self.free.saturating_sub(self.reserved)
    }
}

/// One NUMA node and its CPUs.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct NumaNode {
    /// Node number.
    pub id: u32,
    /// Its CPUs (from `cpulist`).
    pub cpus: Vec<usize>,
}

/// The memory cgroup that limits this process most tightly.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct MemoryCgroup {
    /// The cgroup's directory.
    pub path: PathBuf,
    /// 1 or 2.
    pub version: u8,
    /// Its limit in bytes.
    pub limit: u64,
    /// Its usage in bytes.
    pub usage: u64,
}

impl MemoryCgroup {
    /// Bytes the cgroup can still be charged.
    pub fn headroom(&self) -> u64 {
        self.limit.saturating_sub(self.usage)
    }
}

/// The hugetlb cgroup that limits this process's pages of one size most tightly.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct HugetlbCgroup {
    /// The cgroup's directory.
    pub path: PathBuf,
    /// The page size the limit is for.
    pub size: HugePageSize,
    /// Its limit in bytes.
    pub limit: u64,
    /// Its usage in bytes.
    pub usage: u64,
}

/// Facts about this host and process, read once by [`Host::read`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Host {
    /// The base page size in bytes.
    pub page_size: u64,
    /// `MemAvailable`, in bytes (`None` if `/proc/meminfo` has no such line).
    pub mem_available: Option<u64>,
    /// The hugetlb pools this kernel has.
    pub hugetlb_pools: Vec<HugetlbPool>,
    /// The NUMA nodes (empty when sysfs shows none).
    pub numa_nodes: Vec<NumaNode>,
    /// The memory cgroup with the least headroom, if any sets a limit.
    pub memory_cgroup: Option<MemoryCgroup>,
    /// Per hugetlb page size, the hugetlb cgroup with the least headroom, where one sets a
    /// limit.
    pub hugetlb_cgroups: Vec<HugetlbCgroup>,
    /// `CapEff` of this process.
    pub cap_eff: u64,
    /// `VmLck` of this process, in bytes.
    pub locked_bytes: u64,
    /// Soft `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
    pub memlock_limit: Option<u64>,
    /// THP mode: the selected word of `transparent_hugepage/enabled` (`always`, `madvise`,
    /// `never`), or `unknown`.
    pub thp_mode: String,
    /// THP defrag mode: the selected word of `transparent_hugepage/defrag`, or `unknown`.
    pub thp_defrag: String,
    /// `vm.max_map_count` (`None` if unreadable).
    pub max_map_count: Option<u64>,
    /// Mappings this process has now (lines of `/proc/self/maps`).
    pub map_count: u64,
}

/// What one region asks of the host: its size and backing, and what of it is resident and
/// locked already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Demand {
    /// Guest address of the region, to name it.
    pub guest_addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its hugetlb page size, if hugetlb-backed.
    pub hugetlb: Option<HugePageSize>,
    /// How its hugetlb pages are reserved.
    pub reserve: Reserve,
    /// Mappings (VMAs) it adds: the body and its guards.
    pub mappings: u64,
    /// Bytes already resident.
    pub resident: u64,
    /// Bytes already locked.
    pub locked: u64,
    /// NUMA node it is bound to.
    pub numa_node: Option<u32>,
}

impl Demand {
    /// What a region that `spec` describes asks for before it is mapped.
    pub fn of_spec(spec: &RegionSpec) -> Demand {
        Demand {
            guest_addr: spec.guest_addr().0,
            size: spec.size(),
            hugetlb: match spec.backing() {
                Backing::Hugetlb(h) => Some(*h),
                _ => None,
            },
            reserve: spec.reserve,
            mappings: match spec.guard {
                crate::layout::Guard::On => 3,
                crate::layout::Guard::Off => 1,
            },
            resident: 0,
            locked: 0,
            numa_node: spec.numa_node,
        }
    }
}

/// When a check is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// Before mapping: reserved hugetlb pages, mappings, NUMA nodes.
    Map,
    /// Before populating (and pinning, if `pin`): memory, `MAP_NORESERVE` hugetlb pages,
    /// locked memory.
    Populate {
        /// Whether every non-hugetlb region will be locked.
        pin: bool,
    },
}

/// What a set of regions needs from one hugetlb pool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PoolNeed {
    /// The page size.
    pub size: HugePageSize,
    /// Pages needed.
    pub needed: u64,
    /// Free, unreserved pages in the pool.
    pub available: u64,
}

/// What a set of regions needs, and the limits it was checked against.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Needs {
    /// Ordinary bytes not yet resident (0 at [`Stage::Map`]).
    pub memory_bytes: u64,
    /// `MemAvailable`.
    pub mem_available: Option<u64>,
    /// Bytes locked once pinning is done, what is locked already included (0 when not
    /// pinning).
    pub memlock_bytes: u64,
    /// `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
    pub memlock_limit: Option<u64>,
    /// Whether the process has `CAP_IPC_LOCK` (then the limit does not apply).
    pub cap_ipc_lock: bool,
    /// Needs per hugetlb pool.
    pub pools: Vec<PoolNeed>,
    /// Mappings added (0 at [`Stage::Populate`]).
    pub mappings: u64,
}

impl Host {
    /// Reads every fact once. A fact that cannot be read is left at its "no limit" value
    /// (no cgroup, unlimited memlock, unknown THP mode), never guessed stricter.
    pub fn read() -> Host {
        let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
        let status_kb = |key: &str| {
            status
                .lines()
                .find_map(|l| l.strip_prefix(key))
                .and_then(|v| v.trim().strip_suffix("kB"))
                .and_then(|v| v.trim().parse::<u64>().ok())
        };
        Host {
            page_size: crate::sys::base_page_size(),
            mem_available: meminfo_bytes(
                &std::fs::read_to_string("/proc/meminfo").unwrap_or_default(),
                "MemAvailable:",
            ),
            hugetlb_pools: [HugePageSize::Size2M, HugePageSize::Size1G]
                .into_iter()
                .filter_map(read_pool)
                .collect(),
            numa_nodes: read_nodes(Path::new(NODE_SYSFS)),
            memory_cgroup: read_memory_cgroup(),
            hugetlb_cgroups: read_hugetlb_cgroups(),
            cap_eff: parse_cap_eff(&status).unwrap_or(0),
            locked_bytes: status_kb("VmLck:").map_or(0, |kb| kb * 1024),
            memlock_limit: crate::sys::memlock_limit().unwrap_or(None),
            thp_mode: read_thp_word("enabled"),
            thp_defrag: read_thp_word("defrag"),
            max_map_count: read_u64("/proc/sys/vm/max_map_count"),
            map_count: std::fs::read("/proc/self/maps")
                .map_or(0, |b| b.iter().filter(|&&c| c == b'\n').count() as u64),
        }
    }

    /// The pool of `size`, if this kernel has one.
    pub fn pool(&self, size: HugePageSize) -> Option<&HugetlbPool> {
        self.hugetlb_pools.iter().find(|p| p.size == size)
    }

    /// The CPUs of NUMA node `node`, if it exists.
    pub fn node_cpus(&self, node: u32) -> Option<&[usize]> {
        self.numa_nodes
            .iter()
            .find(|n| n.id == node)
            .map(|n| n.cpus.as_slice())
    }

    /// Whether this process has `CAP_IPC_LOCK` (then `RLIMIT_MEMLOCK` does not apply).
    pub fn cap_ipc_lock(&self) -> bool {
        self.cap_eff & (1 << CAP_IPC_LOCK) != 0
    }

    /// What `demands` need at `stage`, checked against this host: the first shortfall is
    /// refused, naming the region at fault where there is one.
    pub fn check(&self, demands: &[Demand], stage: Stage) -> Result<Needs, HostError> {
        let mut needs = Needs {
            mem_available: self.mem_available,
            memlock_limit: self.memlock_limit,
            cap_ipc_lock: self.cap_ipc_lock(),
            ..Needs::default()
        };
        self.check_pools(demands, stage, &mut needs)?;
        match stage {
            Stage::Map => self.check_map(demands, &mut needs)?,
            Stage::Populate { pin } => self.check_populate(demands, pin, &mut needs)?,
        }
        Ok(needs)
    }

    /// Hugetlb pages: reserved ones at map time, `MAP_NORESERVE` ones not yet resident at
    /// populate time, per page size against its pool's free pages.
    fn check_pools(
        &self,
        demands: &[Demand],
        stage: Stage,
        needs: &mut Needs,
    ) -> Result<(), HostError> {
        for d in demands {
            let Some(size) = d.hugetlb else {
                continue;
            };
            let pages = match (stage, d.reserve) {
                (Stage::Map, Reserve::Reserve) => d.size / size.bytes(),
                (Stage::Populate { .. }, Reserve::NoReserve) => {
                    d.size.saturating_sub(d.resident) / size.bytes()
                }
                _ => 0,
            };
            let Some(pool) = self.pool(size) else {
                return Err(HostError::HugetlbUnsupported {
                    addr: d.guest_addr,
                    size,
                    dir: size.sysfs_dir(),
                });
            };
            let need = match needs.pools.iter().position(|p| p.size == size) {
                Some(k) => &mut needs.pools[k],
                None => {
                    needs.pools.push(PoolNeed {
                        size,
                        needed: 0,
                        available: pool.available(),
                    });
                    needs.pools.last_mut().expect("just pushed")
                }
            };
            need.needed = need.needed.saturating_add(pages);
            if need.needed > need.available {
                return Err(HostError::HugetlbPool {
                    addr: d.guest_addr,
                    size,
                    needed: need.needed,
                    available: need.available,
                    dir: size.sysfs_dir(),
                });
            }
        }
        Ok(())
    }

    /// At map time: NUMA nodes that exist, mappings under `vm.max_map_count`, hugetlb pages
    /// within their cgroups (which charge a page as it is first touched: past the limit,
    /// a touch through a view would raise `SIGBUS`).
    fn check_map(&self, demands: &[Demand], needs: &mut Needs) -> Result<(), HostError> {
        self.check_hugetlb_cgroups(demands)?;
        for d in demands {
            if let Some(node) = d.numa_node {
                if !self.numa_nodes.iter().any(|n| n.id == node) {
                    return Err(HostError::NoSuchNumaNode {
                        addr: d.guest_addr,
                        node,
                    });
                }
            }
        }
        needs.mappings = demands.iter().fold(0, |n, d| n.saturating_add(d.mappings));
        if let Some(limit) = self.max_map_count {
            if self.map_count.saturating_add(needs.mappings) > limit {
                return Err(HostError::MapCount {
                    needed: needs.mappings,
                    current: self.map_count,
                    limit,
                });
            }
        }
        Ok(())
    }

    /// At populate time: memory not yet resident against `MemAvailable` and the memory
    /// cgroup, hugetlb pages against their cgroups, and what pinning adds against
    /// `RLIMIT_MEMLOCK`.
    fn check_populate(
        &self,
        demands: &[Demand],
        pin: bool,
        needs: &mut Needs,
    ) -> Result<(), HostError> {
        let ordinary = demands.iter().filter(|d| d.hugetlb.is_none());
        needs.memory_bytes = ordinary.clone().fold(0, |n, d| {
            n.saturating_add(d.size.saturating_sub(d.resident))
        });
        if let Some(available) = self.mem_available {
            if needs.memory_bytes > available {
                return Err(HostError::Memory {
                    needed: needs.memory_bytes,
                    available,
                });
            }
        }
        if let Some(cg) = &self.memory_cgroup {
            if needs.memory_bytes > cg.headroom() {
                return Err(HostError::Cgroup {
                    needed: needs.memory_bytes,
                    path: cg.path.clone(),
                    limit: cg.limit,
                    usage: cg.usage,
                });
            }
        }
        self.check_hugetlb_cgroups(demands)?;
        if pin {
            let new = ordinary.fold(0u64, |n, d| {
                n.saturating_add(d.size.saturating_sub(d.locked))
            });
            needs.memlock_bytes = self.locked_bytes.saturating_add(new);
            check_memlock(needs.memlock_bytes, self.memlock_limit, needs.cap_ipc_lock)?;
        }
        Ok(())
    }

    /// Hugetlb pages not yet resident, per page size, against its cgroup's headroom (a fault
    /// past it would raise `SIGBUS`).
    fn check_hugetlb_cgroups(&self, demands: &[Demand]) -> Result<(), HostError> {
        for cg in &self.hugetlb_cgroups {
            let needed: u64 = demands
                .iter()
                .filter(|d| d.hugetlb == Some(cg.size))
                .fold(0u64, |n, d| {
                    n.saturating_add(d.size.saturating_sub(d.resident))
                });
            if needed > cg.limit.saturating_sub(cg.usage) {
                return Err(HostError::HugetlbCgroup {
                    size: cg.size,
                    needed,
                    path: cg.path.clone(),
                    limit: cg.limit,
                    usage: cg.usage,
                });
            }
        }
        Ok(())
    }
}

/// Whether `needed` locked bytes fit under `limit` (`None`: unlimited) or the capability.
pub fn check_memlock(needed: u64, limit: Option<u64>, cap_ipc_lock: bool) -> Result<(), HostError> {
    match limit {
        Some(limit) if !cap_ipc_lock && needed > limit => Err(HostError::Memlock { needed, limit }),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::read::*;
    use super::*;

    fn host() -> Host {
        Host {
            page_size: 4096,
            mem_available: Some(8 << 30),
            hugetlb_pools: vec![HugetlbPool {
                size: HugePageSize::Size2M,
                total: 10,
                free: 6,
                reserved: 2,
            }],
            numa_nodes: vec![NumaNode {
                id: 0,
                cpus: vec![0, 1],
            }],
            memory_cgroup: None,
            hugetlb_cgroups: Vec::new(),
            cap_eff: 0,
            locked_bytes: 1 << 20,
            memlock_limit: Some(64 << 20),
            thp_mode: "madvise".into(),
            thp_defrag: "madvise".into(),
            max_map_count: Some(100),
            map_count: 40,
        }
    }

    fn demand(addr: u64, size: u64) -> Demand {
        Demand::of_spec(&RegionSpec::new(vm_memory::GuestAddress(addr), size))
    }

    fn huge(addr: u64, pages: u64, reserve: Reserve) -> Demand {
        Demand {
            hugetlb: Some(HugePageSize::Size2M),
            reserve,
            ..demand(addr, pages * (2 << 20))
        }
    }

    #[test]
    fn check_map_names_first_region_past_the_pool() {
        let h = host();
        let d = [
            huge(0, 3, Reserve::Reserve),
            huge(1 << 30, 1, Reserve::NoReserve),
            huge(2 << 30, 2, Reserve::Reserve),
        ];
        let e = h.check(&d, Stage::Map).unwrap_err();
        assert_eq!(
            e,
            HostError::HugetlbPool {
                addr: 2 << 30,
                size: HugePageSize::Size2M,
                needed: 5,
                available: 4,
                dir: HugePageSize::Size2M.sysfs_dir(),
            }
        );
        assert!(e.to_string().contains("region at 0x80000000"), "{e}");
    }

    #[test]
    fn check_populate_counts_only_noreserve_pages_not_resident() {
        let h = host();
        let mut d = [
            huge(0, 8, Reserve::Reserve),
            huge(1 << 30, 6, Reserve::NoReserve),
        ];
        assert!(matches!(
            h.check(&d, Stage::Populate { pin: false }),
            Err(HostError::HugetlbPool { needed: 6, available: 4, addr, .. }) if addr == 1 << 30
        ));
        d[1].resident = 2 * (2 << 20);
        let n = h.check(&d, Stage::Populate { pin: false }).unwrap();
        assert_eq!(n.pools[0].needed, 4);
    }

    #[test]
    fn check_populate_memory_counts_ordinary_bytes_not_resident() {
        let h = host();
        let mut d = [demand(0, 9 << 30)];
        let e = h.check(&d, Stage::Populate { pin: false }).unwrap_err();
        assert!(
            matches!(e, HostError::Memory { needed, available } if needed == 9 << 30 && available == 8 << 30)
        );
        d[0].resident = 2 << 30;
        assert_eq!(
            h.check(&d, Stage::Populate { pin: false })
                .unwrap()
                .memory_bytes,
            7 << 30
        );
    }

    #[test]
    fn check_populate_cgroup_names_limit_and_usage() {
        let mut h = host();
        h.memory_cgroup = Some(MemoryCgroup {
            path: "/sys/fs/cgroup/test".into(),
            version: 2,
            limit: 256 << 20,
            usage: 56 << 20,
        });
        let e = h
            .check(&[demand(0, 1 << 30)], Stage::Populate { pin: false })
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/sys/fs/cgroup/test")
                && msg.contains(&(256u64 << 20).to_string())
                && msg.contains(&(56u64 << 20).to_string()),
            "{msg}"
        );
    }

    #[test]
    fn check_populate_hugetlb_cgroup_counts_pages_not_yet_resident() {
        let mut h = host();
        h.hugetlb_pools[0].free = 100;
        h.hugetlb_cgroups.push(HugetlbCgroup {
            path: "/sys/fs/cgroup/hugetlb/vm".into(),
            size: HugePageSize::Size2M,
            limit: 8 << 20,
            usage: 2 << 20,
        });
        // 4 pages of a reserved region are 8 MiB: more than the 6 MiB left.
        let mut d = [huge(0, 4, Reserve::Reserve)];
        let e = h.check(&d, Stage::Populate { pin: false }).unwrap_err();
        assert!(
            matches!(&e, HostError::HugetlbCgroup { needed, limit, usage, .. }
                if *needed == 8 << 20 && *limit == 8 << 20 && *usage == 2 << 20),
            "{e}"
        );
        assert!(e.to_string().contains("/sys/fs/cgroup/hugetlb/vm"), "{e}");
        // With one page resident already, 6 MiB are needed: they fit.
        d[0].resident = 2 << 20;
        assert!(h.check(&d, Stage::Populate { pin: false }).is_ok());
        assert_eq!(
            cgroup::cgroup_dir("7:hugetlb:/vm\n0::/\n", Path::new("/cg"), "hugetlb"),
            Some((1, PathBuf::from("/cg/hugetlb/vm")))
        );
    }

    #[test]
    fn check_populate_memlock_counts_already_locked_and_skips_hugetlb() {
        let mut h = host();
        let d = [demand(0, 64 << 20), huge(1 << 30, 100, Reserve::Reserve)];
        let e = h.check(&d, Stage::Populate { pin: true }).unwrap_err();
        assert_eq!(
            e,
            HostError::Memlock {
                needed: (64 << 20) + (1 << 20),
                limit: 64 << 20
            }
        );
        h.cap_eff = 1 << CAP_IPC_LOCK;
        assert!(h.check(&d, Stage::Populate { pin: true }).is_ok());
        assert!(h.check(&d, Stage::Populate { pin: false }).is_ok());
    }

    #[test]
    fn check_map_counts_mappings_and_nodes() {
        let h = host();
        let d: Vec<Demand> = (0..21).map(|i| demand(i << 30, 4096)).collect();
        let e = h.check(&d, Stage::Map).unwrap_err();
        assert_eq!(
            e,
            HostError::MapCount {
                needed: 63,
                current: 40,
                limit: 100
            }
        );
        assert!(h.check(&d[..20], Stage::Map).is_ok());
        let mut n = demand(0, 4096);
        n.numa_node = Some(3);
        assert_eq!(
            h.check(&[n], Stage::Map).unwrap_err(),
            HostError::NoSuchNumaNode { addr: 0, node: 3 }
        );
    }

    #[test]
    fn check_memlock_capability_or_unlimited_passes() {
        assert!(check_memlock(10 << 20, Some(8 << 20), true).is_ok());
        assert!(check_memlock(u64::MAX, None, false).is_ok());
        assert!(check_memlock(8 << 20, Some(8 << 20), false).is_ok());
        assert!(check_memlock((8 << 20) + 1, Some(8 << 20), false).is_err());
    }

    #[test]
    fn parsers_read_kernel_formats() {
        assert_eq!(parse_cpu_list("0-3,8,10-11\n"), vec![0, 1, 2, 3, 8, 10, 11]);
        assert_eq!(parse_cpu_list(""), Vec::<usize>::new());
        assert_eq!(
            parse_thp_mode("always [madvise] never\n").as_deref(),
            Some("madvise")
        );
        let s = "Name:\tx\nCapEff:\t000001fffeffffff\n";
        assert_ne!(parse_cap_eff(s).unwrap() & (1 << CAP_IPC_LOCK), 0);
        assert_eq!(parse_cap_eff("Name: x\n"), None);
        assert_eq!(
            meminfo_bytes(
                "MemTotal: 10 kB\nMemAvailable:   2048 kB\n",
                "MemAvailable:"
            ),
            Some(2 << 20)
        );
        let root = Path::new("/cg");
        assert_eq!(
            cgroup::cgroup_dir("4:memory:/a/b\n0::/\n", root, "memory"),
            Some((1, PathBuf::from("/cg/memory/a/b")))
        );
        assert_eq!(
            cgroup::cgroup_dir("0::/user.slice/x\n", root, "memory"),
            Some((2, PathBuf::from("/cg/user.slice/x")))
        );
    }

    #[test]
    fn read_finds_this_hosts_facts() {
        let h = Host::read();
        assert!(h.page_size.is_power_of_two());
        assert!(h.map_count > 0);
        assert!(h.mem_available.is_some_and(|m| m > 0));
    }
}
