//! Checks a populate-and-pin request against the host's limits before any memory is touched.
//!
//! Design choice: the checks are a separate step, [`check`], not part of
//! [`crate::populate::populate`]. `populate` is the mechanism and does what it is told, so a
//! test (or a VMM that knows better) can drive it into a real failure to exercise the undo
//! path; [`crate::bringup::bringup`] is the policy and always checks first. A failed check
//! names the numbers (needed, limit), so a person can fix the host rather than guess.
//!
//! - Locked memory: pinning asks the kernel to account every non-hugetlb byte against
//!   `RLIMIT_MEMLOCK`, unless the process has `CAP_IPC_LOCK`. Hugetlb regions are left out:
//!   their pages can never be swapped, and the kernel ignores `mlock` on them (they never show
//!   in `VmLck`), so guestmem does not lock them.
//! - Hugetlb pools: a [`Reserve::NoReserve`] region takes its pages from the pool only when
//!   populated, so the pool must hold its pages not yet resident. Reserved regions hold their
//!   pages already (the map would have failed otherwise).

use std::collections::BTreeMap;
use std::io;

use crate::inspect::{self, InspectError, ProcessMemory};
use crate::layout::{Backing, HugePageSize, Reserve};
use crate::map::Snapshot;
use crate::populate::PinStrategy;
use crate::region::hugetlb_available;
use crate::sys;

/// Capability number of `CAP_IPC_LOCK` (linux/capability.h).
pub const CAP_IPC_LOCK: u32 = 14;

/// Why a request exceeds the host's limits, or the limits could not be read.
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// Pinning would exceed `RLIMIT_MEMLOCK`.
    #[error("pinning needs {needed} bytes of locked memory (already locked included), RLIMIT_MEMLOCK is {limit} bytes; raise it (ulimit -l) or grant CAP_IPC_LOCK")]
    Memlock {
        /// Bytes that would be locked after the request.
        needed: u64,
        /// The soft limit.
        limit: u64,
    },
    /// A hugetlb pool holds fewer free pages than the `MAP_NORESERVE` regions need.
    #[error("populating needs {needed} free {size} hugetlb pages, pool has {available} (raise {dir}/nr_hugepages)")]
    HugetlbPool {
        /// The page size.
        size: HugePageSize,
        /// Pages needed.
        needed: u64,
        /// Free, unreserved pages.
        available: u64,
        /// The pool's sysfs directory.
        dir: String,
    },
    /// The pool for a page size does not exist on this kernel.
    #[error("this kernel has no {0} hugetlb pool")]
    NoHugetlbPool(HugePageSize),
    /// A limit could not be read.
    #[error("reading {what}: {source}")]
    Read {
        /// What was being read.
        what: &'static str,
        /// The error.
        source: io::Error,
    },
    /// The kernel's account of the regions could not be read.
    #[error(transparent)]
    Inspect(#[from] InspectError),
}

/// What a request needs from one hugetlb pool.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct PoolNeed {
    /// The page size.
    pub size: HugePageSize,
    /// Pages the `MAP_NORESERVE` regions still need.
    pub needed: u64,
    /// Free, unreserved pages in the pool.
    pub available: u64,
}

/// What a request needs, and the limits it was checked against.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Needs {
    /// Bytes that will be locked once pinning is done, counting what is locked already
    /// (0 when not pinning).
    pub memlock_bytes: u64,
    /// `RLIMIT_MEMLOCK` in bytes; `None` when unlimited.
    pub memlock_limit: Option<u64>,
    /// Whether the process has `CAP_IPC_LOCK` (then the limit does not apply).
    pub cap_ipc_lock: bool,
    /// Needs per hugetlb pool.
    pub pools: Vec<PoolNeed>,
}

/// Checks pinning (by `pin`) and populating every region of `snap` against the host's limits.
pub fn check(snap: &Snapshot, pin: PinStrategy) -> Result<Needs, LimitError> {
    let usage = inspect::inspect(snap)?;
    let mut needs = Needs::default();
    if pin != PinStrategy::None {
        let already = ProcessMemory::read()?.locked;
        let new: u64 = snap
            .regions()
            .iter()
            .zip(&usage)
            .filter(|(r, _)| !r.is_hugetlb())
            .map(|(r, u)| r.size().saturating_sub(u.locked))
            .sum();
        needs.memlock_bytes = already.saturating_add(new);
        needs.memlock_limit = sys::memlock_limit().map_err(|source| LimitError::Read {
            what: "RLIMIT_MEMLOCK",
            source,
        })?;
        needs.cap_ipc_lock = has_cap_ipc_lock()?;
        check_memlock(needs.memlock_bytes, needs.memlock_limit, needs.cap_ipc_lock)?;
    }
    let mut per_pool: BTreeMap<u64, (HugePageSize, u64)> = BTreeMap::new();
    for (r, u) in snap.regions().iter().zip(&usage) {
        if let (Backing::Hugetlb(h), Reserve::NoReserve) = (r.backing(), r.reserve()) {
            let pages = r.size().saturating_sub(u.resident) / h.bytes();
            per_pool.entry(h.bytes()).or_insert((*h, 0)).1 += pages;
        }
    }
    for (size, needed) in per_pool.into_values() {
        let available = hugetlb_available(size).ok_or(LimitError::NoHugetlbPool(size))?;
        if needed > available {
            return Err(LimitError::HugetlbPool {
                size,
                needed,
                available,
                dir: size.sysfs_dir(),
            });
        }
        needs.pools.push(PoolNeed {
            size,
            needed,
            available,
        });
    }
    Ok(needs)
}

/// Whether `needed` locked bytes fit under `limit` (`None`: unlimited) or the capability.
pub fn check_memlock(
    needed: u64,
    limit: Option<u64>,
    cap_ipc_lock: bool,
) -> Result<(), LimitError> {
    match limit {
        Some(limit) if !cap_ipc_lock && needed > limit => {
            Err(LimitError::Memlock { needed, limit })
        }
        _ => Ok(()),
    }
}

/// Whether this process has `CAP_IPC_LOCK` in its effective set (`CapEff` in
/// `/proc/self/status`).
pub fn has_cap_ipc_lock() -> Result<bool, LimitError> {
    let text = std::fs::read_to_string("/proc/self/status").map_err(|source| LimitError::Read {
        what: "/proc/self/status",
        source,
    })?;
    Ok(parse_cap_eff(&text).is_some_and(|caps| caps & (1 << CAP_IPC_LOCK) != 0))
}

/// The `CapEff` bit mask of a `/proc/<pid>/status` text.
fn parse_cap_eff(status: &str) -> Option<u64> {
    let v = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(v, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn check_memlock_over_limit_names_numbers() {
        let e = check_memlock(10 << 20, Some(8 << 20), false).unwrap_err();
        assert!(
            matches!(e, LimitError::Memlock { needed, limit } if needed == 10 << 20 && limit == 8 << 20)
        );
        assert!(e.to_string().contains(&(10u64 << 20).to_string()));
    }

    #[test]
    fn check_memlock_capability_or_unlimited_passes() {
        assert!(check_memlock(10 << 20, Some(8 << 20), true).is_ok());
        assert!(check_memlock(u64::MAX, None, false).is_ok());
        assert!(check_memlock(8 << 20, Some(8 << 20), false).is_ok());
    }

    #[test]
    fn parse_cap_eff_reads_hex_mask() {
        let s = "Name:\tx\nCapPrm:\t0000000000000000\nCapEff:\t000001fffeffffff\n";
        let caps = parse_cap_eff(s).unwrap();
        assert_eq!(caps, 0x1ff_feff_ffff);
        assert_ne!(caps & (1 << CAP_IPC_LOCK), 0);
        assert_eq!(parse_cap_eff("CapEff:\t0000000000000000\n"), Some(0));
        assert_eq!(parse_cap_eff("Name: x\n"), None);
    }
}
