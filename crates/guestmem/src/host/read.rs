//! Reading the host's facts from `/proc` and `/sys`: each reader returns what it found, or
//! nothing, and never panics on what the kernel (or a test) hands it.

use std::path::Path;

use super::NODE_SYSFS;
use crate::layout::HugePageSize;

use super::{HugetlbPool, NumaNode};

pub(crate) fn read_u64(path: impl AsRef<Path>) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

/// A `Key:   123 kB` line of a meminfo-style text, in bytes.
pub(super) fn meminfo_bytes(text: &str, key: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(key))
        .and_then(|v| v.trim().strip_suffix("kB"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|kb| kb * 1024)
}

pub(super) fn read_pool(size: HugePageSize) -> Option<HugetlbPool> {
    let dir = size.sysfs_dir();
    let read = |f: &str| read_u64(format!("{dir}/{f}"));
    Some(HugetlbPool {
        size,
        total: read("nr_hugepages").unwrap_or(0),
        free: read("free_hugepages")?,
        reserved: read("resv_hugepages").unwrap_or(0),
    })
}

/// This host's NUMA nodes and their CPUs, read from sysfs now (empty when it shows none).
pub(crate) fn numa_nodes() -> Vec<NumaNode> {
    read_nodes(Path::new(NODE_SYSFS))
}

/// The nodes under `dir` (`node0`, `node1`, ...), each with its `cpulist`.
pub(super) fn read_nodes(dir: &Path) -> Vec<NumaNode> {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut nodes: Vec<NumaNode> = entries
        .filter_map(|e| {
            let e = e.ok()?;
            let id = e.file_name().to_str()?.strip_prefix("node")?.parse().ok()?;
            let cpus = std::fs::read_to_string(e.path().join("cpulist"))
                .map(|t| parse_cpu_list(&t))
                .unwrap_or_default();
            Some(NumaNode { id, cpus })
        })
        .collect();
    nodes.sort_by_key(|n| n.id);
    nodes
}

/// CPU numbers past this are not read from a CPU list (the kernel's `NR_CPUS` is at most
/// 8192): a malformed list cannot make the reader allocate without bound.
const MAX_CPU_ID: usize = 1 << 16;

/// A kernel CPU list (`0-3,8,10-11`); malformed parts, and CPUs past [`MAX_CPU_ID`], are
/// skipped.
pub(crate) fn parse_cpu_list(text: &str) -> Vec<usize> {
    let mut cpus = Vec::new();
    for part in text.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    cpus.extend(a..=b.min(MAX_CPU_ID));
                }
            }
            None => cpus.extend(part.parse::<usize>().ok().filter(|&c| c <= MAX_CPU_ID)),
        }
    }
    cpus
}

/// The selected word of `/sys/kernel/mm/transparent_hugepage/<file>`.
pub(super) fn read_thp_word(file: &str) -> String {
    std::fs::read_to_string(format!("/sys/kernel/mm/transparent_hugepage/{file}"))
        .ok()
        .and_then(|t| parse_thp_mode(&t))
        .unwrap_or_else(|| "unknown".into())
}

/// The bracketed word of `always [madvise] never`.
pub(super) fn parse_thp_mode(text: &str) -> Option<String> {
    let start = text.find('[')? + 1;
    let end = start + text[start..].find(']')?;
    Some(text[start..end].to_string())
}

/// The `CapEff` bit mask of a `/proc/<pid>/status` text.
pub(super) fn parse_cap_eff(status: &str) -> Option<u64> {
    let v = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))?
        .trim();
    u64::from_str_radix(v, 16).ok()
}
