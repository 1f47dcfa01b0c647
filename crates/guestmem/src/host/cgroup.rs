//! The cgroup limits a host check needs: the memory cgroup and the hugetlb cgroup that limit
//! this process most tightly, from `/proc/self/cgroup` and cgroupfs, v1 or v2.

use std::path::{Path, PathBuf};

use super::{read_u64, HugetlbCgroup, MemoryCgroup};
use crate::layout::HugePageSize;

/// A cgroup limit at or above this many bytes means "no limit" (cgroup v1 reports
/// `PAGE_COUNTER_MAX` pages, about 2^63 bytes, for an unlimited group).
const CGROUP_UNLIMITED_BYTES: u64 = 1 << 60;

/// Where the cgroup file systems are mounted.
const CGROUP_ROOT: &str = "/sys/fs/cgroup";

/// The memory cgroup with the least headroom among this process's cgroup and its ancestors,
/// v2 (`memory.max`, `memory.current`) or v1 (`memory.limit_in_bytes`,
/// `memory.usage_in_bytes`); `None` when none sets a limit.
pub(super) fn read_memory_cgroup() -> Option<MemoryCgroup> {
    let text = std::fs::read_to_string("/proc/self/cgroup").ok()?;
    let (version, dir) = cgroup_dir(&text, Path::new(CGROUP_ROOT), "memory")?;
    let (limit_file, usage_file) = match version {
        2 => ("memory.max", "memory.current"),
        _ => ("memory.limit_in_bytes", "memory.usage_in_bytes"),
    };
    let mount = match version {
        2 => PathBuf::from(CGROUP_ROOT),
        _ => Path::new(CGROUP_ROOT).join("memory"),
    };
    let mut best: Option<MemoryCgroup> = None;
    for d in dir.ancestors().take_while(|d| d.starts_with(&mount)) {
        let Some(limit) = std::fs::read_to_string(d.join(limit_file))
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .filter(|&l| l < CGROUP_UNLIMITED_BYTES)
        else {
            continue; // "max", unreadable, or unlimited
        };
        let usage = read_u64(d.join(usage_file)).unwrap_or(0);
        let cg = MemoryCgroup {
            path: d.to_path_buf(),
            version,
            limit,
            usage,
        };
        if best.as_ref().is_none_or(|b| cg.headroom() < b.headroom()) {
            best = Some(cg);
        }
    }
    best
}

/// The tightest hugetlb cgroup limit of each page size, among this process's hugetlb
/// cgroup and its ancestors: v1 (`hugetlb.2MB.limit_in_bytes`, `.usage_in_bytes`) or v2
/// (`hugetlb.2MB.max`, `.current`). Sizes without a limit are left out.
pub(super) fn read_hugetlb_cgroups() -> Vec<HugetlbCgroup> {
    let Ok(text) = std::fs::read_to_string("/proc/self/cgroup") else {
        return Vec::new();
    };
    let Some((version, dir)) = cgroup_dir(&text, Path::new(CGROUP_ROOT), "hugetlb") else {
        return Vec::new();
    };
    let mount = match version {
        2 => PathBuf::from(CGROUP_ROOT),
        _ => Path::new(CGROUP_ROOT).join("hugetlb"),
    };
    let mut out: Vec<HugetlbCgroup> = Vec::new();
    for size in [HugePageSize::Size2M, HugePageSize::Size1G] {
        let name = match size {
            HugePageSize::Size2M => "2MB",
            HugePageSize::Size1G => "1GB",
        };
        let (limit_file, usage_file) = match version {
            2 => (
                format!("hugetlb.{name}.max"),
                format!("hugetlb.{name}.current"),
            ),
            _ => (
                format!("hugetlb.{name}.limit_in_bytes"),
                format!("hugetlb.{name}.usage_in_bytes"),
            ),
        };
        for d in dir.ancestors().take_while(|d| d.starts_with(&mount)) {
            let Some(limit) = std::fs::read_to_string(d.join(&limit_file))
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
                .filter(|&l| l < CGROUP_UNLIMITED_BYTES)
            else {
                continue;
            };
            let usage = read_u64(d.join(&usage_file)).unwrap_or(0);
            let cg = HugetlbCgroup {
                path: d.to_path_buf(),
                size,
                limit,
                usage,
            };
            match out.iter_mut().find(|c| c.size == size) {
                Some(c) if cg.limit.saturating_sub(cg.usage) < c.limit.saturating_sub(c.usage) => {
                    *c = cg
                }
                Some(_) => {}
                None => out.push(cg),
            }
        }
    }
    out
}

/// The directory of this process's cgroup for `controller`, from a `/proc/self/cgroup`
/// text: the v1 controller's if it is mounted, else the v2 unified one.
pub(super) fn cgroup_dir(text: &str, root: &Path, controller: &str) -> Option<(u8, PathBuf)> {
    let mut v2 = None;
    for line in text.lines() {
        let mut f = line.splitn(3, ':');
        let (_, controllers, path) = (f.next()?, f.next()?, f.next()?);
        let rel = path.trim_start_matches('/');
        if controllers.split(',').any(|c| c == controller) {
            return Some((1, root.join(controller).join(rel)));
        }
        if controllers.is_empty() {
            v2 = Some((2, root.join(rel)));
        }
    }
    v2
}
