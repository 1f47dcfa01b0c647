//! What the kernel really did with a region: resident bytes, huge-page bytes, locked bytes,
//! NUMA placement, read from `/proc/self/smaps` and `/proc/self/numa_maps`.
//!
//! A region's figures are the sum of the smaps VMAs that lie wholly inside it. Guards keep a
//! region's VMA apart from its neighbours; a region mapped without guards can be merged by the
//! kernel with an adjacent mapping of identical flags, and its figures then read as zero.
//!
//! Coverage is measured, never assumed: a region is only as fast as the huge pages the kernel
//! actually gave it, and a stray guard page or a late THP advice silently costs some.

use std::collections::BTreeMap;
use std::io;

use crate::map::MapView;
use crate::region::Region;

/// Why an inspection failed.
#[derive(Debug, thiserror::Error)]
pub enum InspectError {
    /// A procfs file of another process could not be read.
    #[error("reading {path}: {source} (does the process exist, and may this user read it?)")]
    ReadPath {
        /// The file.
        path: String,
        /// The error.
        source: io::Error,
    },
    /// A procfs file could not be read.
    #[error("reading {path}: {source}")]
    Read {
        /// The file.
        path: &'static str,
        /// The error.
        source: io::Error,
    },
}

/// The kernel's account of one region.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct RegionUsage {
    /// Guest address of the region.
    pub guest_addr: u64,
    /// Size of the region.
    pub size: u64,
    /// Bytes resident (smaps `Rss`, plus hugetlb pages, which smaps counts apart).
    pub resident: u64,
    /// Bytes mapped by huge pages: `AnonHugePages + ShmemPmdMapped + FilePmdMapped` plus
    /// hugetlb pages.
    pub huge: u64,
    /// Bytes locked (smaps `Locked`).
    pub locked: u64,
    /// Bytes of the region that huge pages could cover: the span between its first and last
    /// boundary of its huge-page size.
    pub huge_span: u64,
    /// Resident bytes per NUMA node (empty if numa_maps is unavailable).
    pub numa: BTreeMap<u32, u64>,
}

impl RegionUsage {
    /// `huge / huge_span`, as a fraction (0 when the span is empty).
    pub fn huge_coverage(&self) -> f64 {
        if self.huge_span == 0 {
            0.0
        } else {
            self.huge as f64 / self.huge_span as f64
        }
    }
}

/// One VMA of smaps: its range and the fields guestmem reads, in bytes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Vma {
    start: u64,
    end: u64,
    rss: u64,
    huge: u64,
    hugetlb: u64,
    locked: u64,
    /// `KernelPageSize`, in bytes.
    page: u64,
    /// The pathname field of the header (empty for anonymous memory).
    name: String,
}

fn parse_range(line: &str) -> Option<(u64, u64)> {
    let range = line.split_whitespace().next()?;
    let (a, b) = range.split_once('-')?;
    Some((
        u64::from_str_radix(a, 16).ok()?,
        u64::from_str_radix(b, 16).ok()?,
    ))
}

pub(crate) fn parse_smaps(text: &str) -> Vec<Vma> {
    let mut out: Vec<Vma> = Vec::new();
    for line in text.lines() {
        if let Some((k, v)) = line.split_once(':') {
            // Field lines are "Name:   123 kB"; VMA header lines start with a hex range and
            // contain a ':' only inside the device field, which has no "kB".
            let kb = v
                .trim()
                .strip_suffix("kB")
                .and_then(|n| n.trim().parse::<u64>().ok());
            if let (Some(kb), Some(vma)) = (kb, out.last_mut()) {
                let bytes = kb.saturating_mul(1024);
                match k {
                    "Rss" => vma.rss = bytes,
                    "AnonHugePages" | "ShmemPmdMapped" | "FilePmdMapped" => {
                        vma.huge = vma.huge.saturating_add(bytes)
                    }
                    "Shared_Hugetlb" | "Private_Hugetlb" => {
                        vma.hugetlb = vma.hugetlb.saturating_add(bytes)
                    }
                    "Locked" => vma.locked = bytes,
                    "KernelPageSize" => vma.page = bytes,
                    _ => {}
                }
                continue;
            }
        }
        if let Some((start, end)) = parse_range(line) {
            // "start-end perms offset dev inode [pathname]": the name is what follows the
            // fifth field, and may contain spaces.
            let name = line
                .split_whitespace()
                .skip(5)
                .collect::<Vec<_>>()
                .join(" ");
            out.push(Vma {
                start,
                end,
                name,
                ..Vma::default()
            });
        }
    }
    out
}

/// One numa_maps line: where it starts and its resident bytes per node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NumaLine {
    start: u64,
    nodes: Vec<(u32, u64)>,
}

/// Every line of a numa_maps text, sorted by start address.
pub(crate) fn parse_numa_maps(text: &str) -> Vec<NumaLine> {
    let mut out: Vec<NumaLine> = text
        .lines()
        .filter_map(|line| {
            let mut words = line.split_whitespace();
            let start = u64::from_str_radix(words.next()?, 16).ok()?;
            let words: Vec<&str> = words.collect();
            let page_kb = words
                .iter()
                .find_map(|w| w.strip_prefix("kernelpagesize_kB="))
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(4);
            let nodes = words
                .iter()
                .filter_map(|w| {
                    let (n, pages) = w.strip_prefix('N')?.split_once('=')?;
                    Some((
                        n.parse().ok()?,
                        pages
                            .parse::<u64>()
                            .ok()?
                            .saturating_mul(page_kb)
                            .saturating_mul(1024),
                    ))
                })
                .collect();
            Some(NumaLine { start, nodes })
        })
        .collect();
    out.sort_by_key(|l| l.start);
    out
}

/// Per-node resident bytes of the lines whose start lies in `start..end`: a binary search
/// for the first, then a walk.
fn numa_in(lines: &[NumaLine], start: u64, end: u64) -> BTreeMap<u32, u64> {
    let first = lines.partition_point(|l| l.start < start);
    let mut nodes = BTreeMap::new();
    for l in lines[first..].iter().take_while(|l| l.start < end) {
        for &(n, bytes) in &l.nodes {
            let e: &mut u64 = nodes.entry(n).or_insert(0);
            *e = e.saturating_add(bytes);
        }
    }
    nodes
}

fn read(path: &'static str) -> Result<String, InspectError> {
    std::fs::read_to_string(path).map_err(|source| InspectError::Read { path, source })
}

fn usage_from(region: &Region, vmas: &[Vma], numa: Option<&[NumaLine]>) -> RegionUsage {
    let host = HostRange {
        start: region.host_addr() as u64,
        len: region.size(),
        huge_align: region.huge_align(),
    };
    let mut u = usage_of(host, vmas, numa);
    u.guest_addr = region.guest_addr().0;
    u
}

/// A host address range mapped by someone other than a [`Region`] (a peer VMM's way of
/// mapping, reproduced in the lab), to inspect with `inspect_host_ranges` (feature
/// `lab-internals`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRange {
    /// First host address; smaps VMAs wholly inside `start..start+len` are counted.
    pub start: u64,
    /// Length in bytes.
    pub len: u64,
    /// The huge-page size whose aligned span is reported as `huge_span` (a power of two).
    pub huge_align: u64,
}

/// The figures of the VMAs wholly inside `host`. `vmas` is in address order (as smaps lists
/// them) and non-overlapping, so the first is found by binary search and the walk stops at the
/// first VMA that ends past the range: inspecting R regions costs O(R log V), not O(R V).
fn usage_of(host: HostRange, vmas: &[Vma], numa: Option<&[NumaLine]>) -> RegionUsage {
    let start = host.start;
    let end = start.saturating_add(host.len);
    let mut u = RegionUsage {
        size: host.len,
        ..RegionUsage::default()
    };
    let first = vmas.partition_point(|v| v.start < start);
    for v in vmas[first..].iter().take_while(|v| v.end <= end) {
        u.resident = u.resident.saturating_add(v.rss.saturating_add(v.hugetlb));
        u.huge = u.huge.saturating_add(v.huge.saturating_add(v.hugetlb));
        u.locked = u.locked.saturating_add(v.locked);
    }
    let a = host.huge_align.max(1);
    let span_start = start.div_ceil(a).saturating_mul(a);
    let span_end = end / a * a;
    u.huge_span = span_end.saturating_sub(span_start);
    if let Some(lines) = numa {
        u.numa = numa_in(lines, start, end);
    }
    u
}

/// The kernel's account of every region of `snap`, from one read of smaps and one of
/// numa_maps: linear in the number of regions (each found by binary search).
pub fn inspect(snap: &MapView) -> Result<Vec<RegionUsage>, InspectError> {
    inspect_regions(snap.regions())
}

/// The kernel's account of each of `regions`, from one read of smaps and one of numa_maps.
pub fn inspect_regions(
    regions: &[std::sync::Arc<Region>],
) -> Result<Vec<RegionUsage>, InspectError> {
    let vmas = read_vmas()?;
    let numa = read_numa();
    Ok(regions
        .iter()
        .map(|r| usage_from(r, &vmas, numa.as_deref()))
        .collect())
}

/// The kernel's account of one region.
pub fn inspect_region(region: &Region) -> Result<RegionUsage, InspectError> {
    Ok(usage_from(region, &read_vmas()?, read_numa().as_deref()))
}

/// This process's VMAs from smaps, in address order.
fn read_vmas() -> Result<Vec<Vma>, InspectError> {
    let mut vmas = parse_smaps(&read("/proc/self/smaps")?);
    // smaps lists VMAs in address order already; sorting a sorted list is one pass.
    vmas.sort_by_key(|v| v.start);
    Ok(vmas)
}

/// This process's numa_maps lines, if the kernel has NUMA support.
fn read_numa() -> Option<Vec<NumaLine>> {
    read("/proc/self/numa_maps")
        .ok()
        .map(|t| parse_numa_maps(&t))
}

/// The kernel's account of host ranges that are not [`Region`]s, added together (its
/// `guest_addr` is 0): the lab uses it to measure peers that map memory their own way.
///
/// Plain adjacent anonymous mappings may be merged by the kernel into one VMA, and smaps
/// cannot split a VMA's figures; so the ranges are first joined where they touch, and a VMA
/// is counted when it lies wholly inside one joined span. A VMA the kernel merged with a
/// mapping outside the ranges is not counted, which shows as `resident < size`.
/// `huge_span` is the sum of each range's own aligned span.
#[cfg(feature = "lab-internals")]
pub fn inspect_host_ranges(ranges: &[HostRange]) -> Result<RegionUsage, InspectError> {
    let vmas = read_vmas()?;
    let mut sorted: Vec<(u64, u64)> = ranges
        .iter()
        .map(|r| (r.start, r.start.saturating_add(r.len)))
        .collect();
    sorted.sort_unstable();
    let mut spans: Vec<(u64, u64)> = Vec::new();
    for (s, e) in sorted {
        match spans.last_mut() {
            Some(last) if s <= last.1 => last.1 = last.1.max(e),
            _ => spans.push((s, e)),
        }
    }
    let mut total = RegionUsage::default();
    for (s, e) in spans {
        let joined = HostRange {
            start: s,
            len: e - s,
            huge_align: 1,
        };
        let u = usage_of(joined, &vmas, None);
        total.resident += u.resident;
        total.huge += u.huge;
        total.locked += u.locked;
    }
    for r in ranges {
        total.size = total.size.saturating_add(r.len);
        total.huge_span = total
            .huge_span
            .saturating_add(usage_of(*r, &[], None).huge_span);
    }
    Ok(total)
}

/// One large mapping of a process, as an operator inspects a running VMM's guest memory.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct MappingUsage {
    /// First host address.
    pub start: u64,
    /// Size in bytes.
    pub size: u64,
    /// What smaps names it (a path, `/memfd:...`, or empty for anonymous memory).
    pub name: String,
    /// The kernel's page size for it (`KernelPageSize`): 4 KiB, or the hugetlb size.
    pub page_size: u64,
    /// Resident bytes (hugetlb included).
    pub resident: u64,
    /// Bytes in huge pages (THP or hugetlb).
    pub huge: u64,
    /// Bytes locked.
    pub locked: u64,
    /// Bytes between the mapping's first and last 2 MiB boundary, where THP could map.
    pub huge_span: u64,
    /// `start` modulo 2 MiB: nonzero means KVM and THP can only use huge pages if the guest
    /// address shares that offset.
    pub offset_2m: u64,
}

/// The mappings of process `pid` (this process if `None`) of at least `min_bytes`, with the
/// kernel's account of each: how a person checks what a running VMM got.
pub fn inspect_process(
    pid: Option<u32>,
    min_bytes: u64,
) -> Result<Vec<MappingUsage>, InspectError> {
    let path = match pid {
        Some(p) => format!("/proc/{p}/smaps"),
        None => "/proc/self/smaps".to_string(),
    };
    let text = std::fs::read_to_string(&path).map_err(|source| InspectError::ReadPath {
        path: path.clone(),
        source,
    })?;
    Ok(mappings_from(&parse_smaps(&text), min_bytes))
}

fn mappings_from(vmas: &[Vma], min_bytes: u64) -> Vec<MappingUsage> {
    vmas.iter()
        .filter(|v| v.end - v.start >= min_bytes)
        .map(|v| {
            let a = crate::layout::THP_BYTES;
            MappingUsage {
                start: v.start,
                size: v.end - v.start,
                name: v.name.clone(),
                page_size: v.page,
                resident: v.rss.saturating_add(v.hugetlb),
                huge: v.huge.saturating_add(v.hugetlb),
                locked: v.locked,
                huge_span: (v.end / a * a).saturating_sub(v.start.div_ceil(a) * a),
                offset_2m: v.start % a,
            }
        })
        .collect()
}

/// The share (0 to 1) of `file`'s pages in the page cache, read with `mincore` on a
/// read-only mapping of it (which reads nothing in): whether a restore from it will read the
/// disk.
pub fn page_cache_share(file: &std::fs::File) -> std::io::Result<f64> {
    use std::os::fd::AsFd;
    let len = usize::try_from(file.metadata()?.len()).map_err(std::io::Error::other)?;
    if len == 0 {
        return Ok(0.0);
    }
    // SAFETY: the mapping is only asked for its residency (mincore), never read by a CPU.
    let m =
        unsafe { crate::mmap::Mapping::file_source(file.as_fd(), len) }.map_err(|e| e.into_io())?;
    let pages = len.div_ceil(crate::sys::base_page_size() as usize);
    let cached = m.resident_pages(0, len).map_err(|e| e.into_io())?;
    Ok(cached as f64 / pages as f64)
}

/// Bytes of process `pid`'s memory in `ranges` (`(start, len)`) that transparent huge pages
/// map (smaps `AnonHugePages` of the VMAs that lie inside a range).
pub(crate) fn anon_huge_in(pid: u32, ranges: &[(u64, u64)]) -> Result<u64, InspectError> {
    let path = format!("/proc/{pid}/smaps");
    let text =
        std::fs::read_to_string(&path).map_err(|source| InspectError::ReadPath { path, source })?;
    Ok(parse_smaps(&text)
        .iter()
        .filter(|v| {
            ranges
                .iter()
                .any(|&(s, l)| v.start >= s && v.end <= s.saturating_add(l))
        })
        .map(|v| v.huge)
        .sum())
}

/// Process-wide memory figures from `/proc/self/status`, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ProcessMemory {
    /// `VmRSS`.
    pub rss: u64,
    /// `VmLck`.
    pub locked: u64,
    /// `HugetlbPages`.
    pub hugetlb: u64,
}

impl ProcessMemory {
    /// Reads this process's figures.
    pub fn read() -> Result<ProcessMemory, InspectError> {
        let text = read("/proc/self/status")?;
        let mut m = ProcessMemory::default();
        for line in text.lines() {
            let Some((k, v)) = line.split_once(':') else {
                continue;
            };
            let Some(kb) = v
                .trim()
                .strip_suffix("kB")
                .and_then(|n| n.trim().parse::<u64>().ok())
            else {
                continue;
            };
            match k {
                "VmRSS" => m.rss = kb * 1024,
                "VmLck" => m.locked = kb * 1024,
                "HugetlbPages" => m.hugetlb = kb * 1024,
                _ => {}
            }
        }
        Ok(m)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_just_written_is_all_in_the_page_cache_and_an_empty_one_has_none() {
        let path = std::env::temp_dir().join(format!("gm-{}-cached", std::process::id()));
        std::fs::write(&path, vec![7u8; 3 * 4096 + 100]).unwrap();
        let f = std::fs::File::open(&path).unwrap();
        assert_eq!(page_cache_share(&f).unwrap(), 1.0);
        std::fs::write(&path, b"").unwrap();
        assert_eq!(page_cache_share(&f).unwrap(), 0.0);
        let _ = std::fs::remove_file(&path);
    }

    const SMAPS: &str = "\
7f0000000000-7f0000400000 rw-p 00000000 00:00 0 
Size:               4096 kB
Rss:                4096 kB
AnonHugePages:      2048 kB
ShmemPmdMapped:        0 kB
Shared_Hugetlb:        0 kB
Private_Hugetlb:       0 kB
Locked:             1024 kB
VmFlags: rd wr mr mw me ac hg
7f0000400000-7f0000600000 rw-s 00000000 00:01 1234  /memfd:guestmem-huge (deleted)
Rss:                   0 kB
Shared_Hugetlb:     2048 kB
Locked:                0 kB
";

    #[test]
    fn mappings_report_names_spans_and_misalignment() {
        let v = parse_smaps(SMAPS);
        assert_eq!(v[1].name, "/memfd:guestmem-huge (deleted)");
        assert_eq!(v[0].name, "");
        let m = mappings_from(&v, 3 << 20);
        assert_eq!(m.len(), 1, "the 2 MiB mapping is below the minimum");
        assert_eq!(m[0].huge_span, 4 << 20);
        assert_eq!(m[0].offset_2m, 0);
        assert_eq!(m[0].huge, 2 << 20);
    }

    #[test]
    fn inspect_process_of_missing_pid_names_the_file() {
        let e = inspect_process(Some(u32::MAX), 0).unwrap_err().to_string();
        assert!(e.contains(&format!("/proc/{}/smaps", u32::MAX)), "{e}");
    }

    #[test]
    fn usage_of_counts_only_vmas_wholly_inside() {
        let vma = |start: u64, end: u64| Vma {
            start,
            end,
            rss: end - start,
            ..Vma::default()
        };
        let vmas = [
            vma(0, 0x1000),
            vma(0x1000, 0x3000),
            vma(0x3000, 0x4000),
            vma(0x4000, 0x9000),
        ];
        let range = HostRange {
            start: 0x1000,
            len: 0x3000,
            huge_align: 1,
        };
        assert_eq!(usage_of(range, &vmas, None).resident, 0x3000);
        let straddling = HostRange {
            start: 0x2000,
            len: 0x4000,
            huge_align: 1,
        };
        assert_eq!(usage_of(straddling, &vmas, None).resident, 0x1000);
    }

    #[test]
    fn parse_smaps_reads_fields_per_vma() {
        let v = parse_smaps(SMAPS);
        assert_eq!(v.len(), 2);
        assert_eq!(v[0].start, 0x7f00_0000_0000);
        assert_eq!(v[0].rss, 4 << 20);
        assert_eq!(v[0].huge, 2 << 20);
        assert_eq!(v[0].locked, 1 << 20);
        assert_eq!(v[1].hugetlb, 2 << 20);
    }

    #[test]
    fn parse_numa_maps_counts_pages_by_node_and_page_size() {
        let text = "7f0000000000 bind:0 anon=3 dirty=3 N0=2 N1=1 kernelpagesize_kB=4\n\
                    7f0000400000 default huge dirty=1 N0=1 kernelpagesize_kB=2048\n\
                    7f1000000000 default anon=1 N0=1 kernelpagesize_kB=4\n";
        let n = numa_in(&parse_numa_maps(text), 0x7f00_0000_0000, 0x7f00_0060_0000);
        assert_eq!(n[&0], 2 * 4096 + (2 << 20));
        assert_eq!(n[&1], 4096);
    }
}
