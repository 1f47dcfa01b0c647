//! Guest memory layouts as people write them: sizes like `512M` and `16G`, an even split
//! into a handful of regions, or a layout file (JSON) that lists each region.
//!
//! Everything here is checked before any memory is mapped, so a bad layout costs nothing.

use std::path::{Path, PathBuf};

use vm_memory::GuestAddress;

use crate::host::{Demand, Host, HostError, Needs, Stage};
use crate::layout::{Access, Backing, Guard, HugePageSize, RegionSpec, Reserve, Thp};

/// Why a layout was refused.
#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    /// A size string could not be read.
    #[error("size {0:?}: expected a number with an optional K, M, G or T suffix (e.g. 512M, 16G)")]
    BadSize(String),
    /// A layout asks for `"reserve": "noreserve"`, which only code can ask for.
    #[error("\"reserve\": \"noreserve\" is not accepted from a layout: a hugetlb region without a reservation raises SIGBUS when touched before it is populated, so only a program that populates it first may ask for one (RegionSpec::with_reserve, an unsafe fn)")]
    NoReserve,
    /// An even layout over a file runs past the largest file offset.
    #[error("file offset {offset:#x} + the layout's size runs past the largest file offset")]
    FileOffsetOverflow {
        /// The first region's file offset.
        offset: u64,
    },
    /// A size string is a number, but too large for 64 bits.
    #[error("size {0:?}: too large (the largest is 16 EiB - 1 byte, 0xffffffffffffffff)")]
    SizeOverflow(String),
    /// A backing name could not be read.
    #[error("backing {0:?}: expected anon, memfd, hugetlb-2M, hugetlb-1G or file:PATH[@OFFSET]")]
    BadBacking(String),
    /// The region count is zero, or the size cannot be split into that many regions.
    #[error("cannot split {size:#x} bytes into {count} regions of whole {granule:#x}-byte pages")]
    BadSplit {
        /// Total size.
        size: u64,
        /// Regions asked for.
        count: u64,
        /// The granule each region must be a multiple of.
        granule: u64,
    },
    /// More regions than a map holds ([`crate::MAX_REGIONS`]).
    #[error("{count} regions asked for: a map holds at most {limit}")]
    TooManyRegions {
        /// Regions asked for.
        count: u64,
        /// The limit.
        limit: usize,
    },
    /// The layout file could not be read or parsed.
    #[error("layout file {path}: {reason}")]
    File {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
}

/// Parses a size as people write it: `4096`, `64K`, `512M`, `16G`, `1T` (binary units; an
/// optional `i`/`iB`/`B` after the letter is accepted).
pub fn parse_size(s: &str) -> Result<u64, PlanError> {
    let bad = || PlanError::BadSize(s.to_string());
    let t = s.trim();
    let t = t
        .strip_suffix("iB")
        .or_else(|| t.strip_suffix('B'))
        .or_else(|| t.strip_suffix('i'))
        .unwrap_or(t);
    let (num, shift) = match t.chars().last().ok_or_else(bad)? {
        'k' | 'K' => (&t[..t.len() - 1], 10),
        'm' | 'M' => (&t[..t.len() - 1], 20),
        'g' | 'G' => (&t[..t.len() - 1], 30),
        't' | 'T' => (&t[..t.len() - 1], 40),
        _ => (t, 0),
    };
    let num = num.trim();
    let too_large = || PlanError::SizeOverflow(s.to_string());
    let parsed = match num.strip_prefix("0x") {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => num.parse::<u64>(),
    };
    let v = parsed.map_err(|e| match e.kind() {
        std::num::IntErrorKind::PosOverflow => too_large(),
        _ => bad(),
    })?;
    v.checked_mul(1u64 << shift).ok_or_else(too_large)
}

/// Parses a backing name: `anon`, `memfd`, `hugetlb-2M`, `hugetlb-1G`, `file:PATH[@OFFSET]`.
pub fn parse_backing(s: &str) -> Result<Backing, PlanError> {
    Ok(match s {
        "anon" | "anonymous" => Backing::Anonymous,
        "memfd" | "shared" => Backing::Memfd,
        "hugetlb" | "hugetlb-2M" | "hugetlb-2m" => Backing::Hugetlb(HugePageSize::Size2M),
        "hugetlb-1G" | "hugetlb-1g" => Backing::Hugetlb(HugePageSize::Size1G),
        _ => {
            let rest = s
                .strip_prefix("file:")
                .ok_or_else(|| PlanError::BadBacking(s.into()))?;
            let (path, offset) = match rest.rsplit_once('@') {
                Some((p, o)) => (p, parse_size(o)?),
                None => (rest, 0),
            };
            Backing::File {
                path: path.into(),
                offset,
            }
        }
    })
}

/// Options shared by every region of an even layout.
#[derive(Debug, Clone)]
pub struct EvenLayout {
    /// Total bytes.
    pub size: u64,
    /// Number of regions.
    pub regions: u64,
    /// Guest address of the first region.
    pub base: GuestAddress,
    /// Backing of every region.
    pub backing: Backing,
    /// THP advice.
    pub thp: Thp,
    /// Guard pages.
    pub guard: Guard,
}

impl EvenLayout {
    /// The region specs: `regions` back-to-back regions of (nearly) equal size, each a
    /// multiple of the backing's huge-page size so every region can be fully huge; the last
    /// region takes the remainder.
    pub fn specs(&self) -> Result<Vec<RegionSpec>, PlanError> {
        let probe = RegionSpec::new(self.base, 1).with_backing(self.backing.clone());
        let granule = probe.huge_align().max(probe.page_size());
        let bad = || PlanError::BadSplit {
            size: self.size,
            count: self.regions,
            granule,
        };
        if self.regions == 0 || !self.size.is_multiple_of(granule) {
            return Err(bad());
        }
        // Before any spec is made: a count past the limit would be refused by the map
        // anyway, after filling memory with specs.
        if self.regions > crate::MAX_REGIONS as u64 {
            return Err(PlanError::TooManyRegions {
                count: self.regions,
                limit: crate::MAX_REGIONS,
            });
        }
        let units = self.size / granule;
        if units < self.regions {
            return Err(bad());
        }
        let per = units / self.regions;
        let mut addr = self.base.0;
        let mut out = Vec::new();
        for i in 0..self.regions {
            let n = if i + 1 == self.regions {
                units - per * (self.regions - 1)
            } else {
                per
            };
            let size = n * granule;
            let backing = match &self.backing {
                // Consecutive regions of one file take consecutive slices of it.
                Backing::File { path, offset } => Backing::File {
                    path: path.clone(),
                    offset: offset
                        .checked_add(addr - self.base.0)
                        .ok_or(PlanError::FileOffsetOverflow { offset: *offset })?,
                },
                b => b.clone(),
            };
            out.push(
                RegionSpec::new(GuestAddress(addr), size)
                    .with_backing(backing)
                    .with_thp(self.thp)
                    .with_guard(self.guard),
            );
            addr = addr.checked_add(size).ok_or_else(bad)?;
        }
        Ok(out)
    }
}

/// A size field of a layout file: a number of bytes or a string like `"512M"`.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(untagged)]
enum SizeField {
    Bytes(u64),
    Text(String),
}

impl SizeField {
    fn get(&self) -> Result<u64, PlanError> {
        match self {
            SizeField::Bytes(b) => Ok(*b),
            SizeField::Text(t) => parse_size(t),
        }
    }
}

/// One region of a layout file.
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RegionEntry {
    addr: SizeField,
    size: SizeField,
    #[serde(default)]
    backing: Option<String>,
    #[serde(default)]
    thp: Option<Thp>,
    #[serde(default)]
    guard: Option<Guard>,
    #[serde(default)]
    node: Option<u32>,
    #[serde(default)]
    access: Option<Access>,
    #[serde(default)]
    reserve: Option<Reserve>,
}

/// Reads a layout file: a JSON array of regions, each
/// `{"addr": "4G", "size": "2G", "backing": "memfd", "thp": "huge", "guard": "on",
/// "node": 0, "access": "read-write", "reserve": "reserve"}`, where only `addr` and `size`
/// are required (and `"reserve": "noreserve"` is refused, see [`PlanError::NoReserve`]).
pub fn read_layout_file(path: &Path) -> Result<Vec<RegionSpec>, PlanError> {
    let err = |reason: String| PlanError::File {
        path: path.to_path_buf(),
        reason,
    };
    let mut text = String::new();
    // O_NONBLOCK: a FIFO named as the layout cannot hang the open; only a regular file is read.
    let f = {
        use std::os::unix::fs::OpenOptionsExt;
        std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(path)
            .map_err(|e| err(e.to_string()))?
    };
    if !f.metadata().is_ok_and(|m| m.is_file()) {
        return Err(err("not a regular file".into()));
    }
    std::io::Read::read_to_string(&mut std::io::Read::take(f, MAX_LAYOUT_BYTES + 1), &mut text)
        .map_err(|e| err(e.to_string()))?;
    if text.len() as u64 > MAX_LAYOUT_BYTES {
        return Err(err(format!("longer than {MAX_LAYOUT_BYTES} bytes")));
    }
    parse_layout(&text).map_err(err)
}

/// Largest layout file read (a JSON object per region; far more than `MAX_REGIONS` need).
pub const MAX_LAYOUT_BYTES: u64 = 16 << 20;

/// Parses a layout file's text (see [`read_layout_file`]); the error says which region and
/// why.
pub fn parse_layout(text: &str) -> Result<Vec<RegionSpec>, String> {
    let err = |reason: String| reason;
    let entries: Vec<RegionEntry> = serde_json::from_str(text).map_err(|e| err(e.to_string()))?;
    if entries.is_empty() {
        return Err(err("the layout lists no regions".into()));
    }
    entries
        .into_iter()
        .enumerate()
        .map(|(i, e)| {
            let ctx = |pe: PlanError| err(format!("region {i}: {pe}"));
            let mut s = RegionSpec::new(
                GuestAddress(e.addr.get().map_err(ctx)?),
                e.size.get().map_err(ctx)?,
            );
            if let Some(b) = &e.backing {
                s = s.with_backing(parse_backing(b).map_err(ctx)?);
            }
            if let Some(t) = e.thp {
                s = s.with_thp(t);
            }
            if let Some(g) = e.guard {
                s = s.with_guard(g);
            }
            if let Some(n) = e.node {
                s = s.with_numa_node(n);
            }
            if let Some(a) = e.access {
                s = s.with_access(a);
            }
            match e.reserve {
                None | Some(Reserve::Reserve) => {}
                // A layout file cannot promise to populate before anything touches memory,
                // which `MAP_NORESERVE` hugetlb needs to be free of SIGBUS.
                Some(Reserve::NoReserve) => {
                    return Err(ctx(PlanError::NoReserve));
                }
            }
            Ok(s)
        })
        .collect()
}

/// Checks a layout against the host before anything is mapped: what mapping it takes
/// (hugetlb pools for reserved regions, NUMA nodes, mappings) and what populating it fresh
/// takes (memory against `MemAvailable` and the memory cgroup, pools for `MAP_NORESERVE`
/// regions). Pinning is checked once the map exists ([`crate::limits::check`]), since what is
/// already locked is only known then.
pub fn check_layout(specs: &[RegionSpec], host: &Host) -> Result<Needs, HostError> {
    let demands: Vec<Demand> = specs.iter().map(Demand::of_spec).collect();
    let mapped = host.check(&demands, Stage::Map)?;
    let populated = host.check(&demands, Stage::Populate { pin: false })?;
    Ok(Needs {
        mappings: mapped.mappings,
        pools: mapped
            .pools
            .into_iter()
            .chain(populated.pools.iter().cloned())
            .collect(),
        ..populated
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_size_reads_people_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("512M").unwrap(), 512 << 20);
        assert_eq!(parse_size("16G").unwrap(), 16 << 30);
        assert_eq!(parse_size("2GiB").unwrap(), 2 << 30);
        assert_eq!(parse_size("64k").unwrap(), 64 << 10);
        assert_eq!(parse_size("0x1000").unwrap(), 4096);
        assert!(parse_size("").is_err());
        assert!(parse_size("12X").is_err());
        assert!(matches!(
            parse_size("99999999999T"),
            Err(PlanError::SizeOverflow(_))
        ));
        assert!(matches!(
            parse_size("99999999999G"),
            Err(PlanError::SizeOverflow(_))
        ));
        assert!(matches!(
            parse_size("99999999999999999999"),
            Err(PlanError::SizeOverflow(_))
        ));
        let e = parse_size("99999999999G").unwrap_err().to_string();
        assert!(e.contains("too large"), "{e}");
    }

    #[test]
    fn even_layout_splits_on_huge_boundaries_and_covers_all() {
        let l = EvenLayout {
            size: 1 << 30,
            regions: 3,
            base: GuestAddress(0),
            backing: Backing::Anonymous,
            thp: Thp::Huge,
            guard: Guard::On,
        };
        let specs = l.specs().unwrap();
        assert_eq!(specs.len(), 3);
        assert_eq!(specs.iter().map(|s| s.size()).sum::<u64>(), 1 << 30);
        for w in specs.windows(2) {
            assert_eq!(w[0].guest_end().unwrap(), w[1].guest_addr().0);
        }
        assert!(specs.iter().all(|s| s.size() % (2 << 20) == 0));
    }

    #[test]
    fn even_layout_refuses_zero_regions_and_ragged_size() {
        let mut l = EvenLayout {
            size: 1 << 30,
            regions: 0,
            base: GuestAddress(0),
            backing: Backing::Anonymous,
            thp: Thp::Huge,
            guard: Guard::On,
        };
        assert!(l.specs().is_err());
        l.regions = 2;
        l.size = (1 << 30) + 4096;
        assert!(l.specs().unwrap_err().to_string().contains("0x200000"));
        // A count past what a map holds is refused before any spec is made (2^39 of them
        // filled memory until the process died).
        l.size = 1 << 60;
        l.regions = 1 << 39;
        let e = l.specs().unwrap_err();
        assert!(
            matches!(e, PlanError::TooManyRegions { count, limit } if count == 1 << 39 && limit == crate::MAX_REGIONS),
            "{e}"
        );
    }

    #[test]
    fn layout_file_reads_regions_and_names_bad_one() {
        let dir = std::env::temp_dir().join(format!("guestmem-layout-{}", std::process::id()));
        std::fs::write(
            &dir,
            r#"[{"addr": 0, "size": "64M"}, {"addr": "4G", "size": 1048576, "backing": "memfd", "thp": "nohuge"}]"#,
        )
        .unwrap();
        let specs = read_layout_file(&dir).unwrap();
        assert_eq!(specs[1].guest_addr().0, 4 << 30);
        assert_eq!(specs[1].backing(), &Backing::Memfd);
        std::fs::write(&dir, r#"[{"addr": 0, "size": "64Q"}]"#).unwrap();
        let e = read_layout_file(&dir).unwrap_err().to_string();
        std::fs::remove_file(&dir).unwrap();
        assert!(e.contains("region 0") && e.contains("64Q"), "{e}");
    }

    #[test]
    fn even_layout_over_a_file_past_the_largest_offset_is_refused() {
        let l = EvenLayout {
            size: 4 << 20,
            regions: 2,
            base: GuestAddress(0),
            backing: Backing::File {
                path: "/tmp/x".into(),
                offset: u64::MAX - 4095,
            },
            thp: Thp::Huge,
            guard: Guard::On,
        };
        assert!(matches!(
            l.specs(),
            Err(PlanError::FileOffsetOverflow { .. })
        ));
    }

    #[test]
    fn layout_file_noreserve_is_refused_with_the_reason() {
        let path = std::env::temp_dir().join(format!("guestmem-nores-{}", std::process::id()));
        std::fs::write(
            &path,
            r#"[{"addr": 0, "size": "2M", "backing": "hugetlb-2M", "reserve": "noreserve"}]"#,
        )
        .unwrap();
        let e = read_layout_file(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("region 0") && e.contains("SIGBUS"), "{e}");
    }

    #[test]
    fn layout_file_with_no_regions_is_refused() {
        let path = std::env::temp_dir().join(format!("guestmem-empty-{}", std::process::id()));
        std::fs::write(&path, "[]").unwrap();
        let e = read_layout_file(&path).unwrap_err().to_string();
        std::fs::remove_file(&path).unwrap();
        assert!(e.contains("no regions"), "{e}");
    }

    #[test]
    fn check_layout_refuses_more_than_available() {
        let host = Host::read();
        let avail = host.mem_available.expect("MemAvailable");
        let specs = [RegionSpec::new(GuestAddress(0), avail + (1 << 30))];
        assert!(matches!(
            check_layout(&specs, &host),
            Err(HostError::Memory { needed, available }) if needed == avail + (1 << 30) && available == avail
        ));
    }
}
