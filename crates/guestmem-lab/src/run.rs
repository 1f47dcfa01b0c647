//! What every lab run records (command, commit, kernel, CPU), where it is written, and how
//! samples are summarised.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{SystemTime, UNIX_EPOCH};

/// Seconds per day, for turning the Unix clock into a UTC date.
const SECONDS_PER_DAY: u64 = 86_400;

/// The machine and command a result came from.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RunInfo {
    /// The command line, as given.
    pub command: String,
    /// `git rev-parse HEAD` in the current directory, if git answered.
    pub git_commit: Option<String>,
    /// Whether `git status --porcelain` listed changes (None without git).
    pub git_dirty: Option<bool>,
    /// `uname -srm`-like: kernel name, release and machine.
    pub kernel: String,
    /// `model name` from `/proc/cpuinfo`.
    pub cpu_model: String,
    /// CPUs this process may run on.
    pub cpus: usize,
    /// When the run started, UTC, `YYYYMMDDTHHMMSSZ`.
    pub started_utc: String,
}

impl RunInfo {
    /// Collects the run's facts now; `command` is the command line to record.
    pub fn collect(command: String) -> RunInfo {
        let git = |args: &[&str]| {
            Command::new("git")
                .args(args)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        };
        RunInfo {
            command,
            git_commit: git(&["rev-parse", "HEAD"]),
            git_dirty: git(&["status", "--porcelain", "--untracked-files=no"])
                .map(|s| !s.is_empty()),
            kernel: kernel(),
            cpu_model: cpu_model(),
            cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            started_utc: utc_timestamp(SystemTime::now()),
        }
    }
}

/// Kernel name, release and machine, as `uname -srm` prints them, from procfs.
fn kernel() -> String {
    let read = |f: &str| {
        std::fs::read_to_string(format!("/proc/sys/kernel/{f}"))
            .map(|t| t.trim().to_string())
            .unwrap_or_else(|_| "unknown".into())
    };
    format!(
        "{} {} {}",
        read("ostype"),
        read("osrelease"),
        std::env::consts::ARCH
    )
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `t` as `YYYYMMDDTHHMMSSZ` (UTC), from the civil-from-days algorithm (H. Hinnant).
pub fn utc_timestamp(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / SECONDS_PER_DAY, secs % SECONDS_PER_DAY);
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}{month:02}{day:02}T{:02}{:02}{:02}Z",
        rem / 3600,
        rem / 60 % 60,
        rem % 60
    )
}

/// Makes sure `base` can hold run folders, before anything is measured: an existing folder
/// is used as it is; a missing one is created, but only it, never its parents (a mistyped
/// `/nonexistent/dir/x` is refused, not built).
pub fn prepare_out(base: &Path) -> std::io::Result<()> {
    match std::fs::metadata(base) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(std::io::Error::new(
            std::io::ErrorKind::AlreadyExists,
            "exists and is not a folder",
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            std::fs::create_dir(base).map_err(|e| match e.kind() {
                std::io::ErrorKind::NotFound => std::io::Error::new(
                    e.kind(),
                    "its parent folder does not exist (only the last folder of the path is created)",
                ),
                _ => e,
            })
        }
        Err(e) => Err(e),
    }
}

/// Creates `<base>/<started_utc>-<scenario>/` (with a numeric suffix if it exists already);
/// `base` itself is created if missing, its parents never (see [`prepare_out`]).
pub fn run_folder(base: &Path, info: &RunInfo, scenario: &str) -> std::io::Result<PathBuf> {
    prepare_out(base)?;
    for n in 0u32.. {
        let name = match n {
            0 => format!("{}-{scenario}", info.started_utc),
            _ => format!("{}-{scenario}-{n}", info.started_utc),
        };
        let dir = base.join(name);
        match std::fs::create_dir(&dir) {
            Ok(()) => return Ok(dir),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(e),
        }
    }
    unreachable!("u32 ran out of suffixes")
}

/// Median, minimum and maximum of a set of samples.
#[derive(Debug, Clone, Copy, Default, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median (the mean of the middle two for an even count).
    pub median: f64,
    /// Smallest sample.
    pub min: f64,
    /// Largest sample.
    pub max: f64,
}

impl Summary {
    /// Summarises `samples` (all zero when empty).
    pub fn of(samples: &[f64]) -> Summary {
        let mut v = samples.to_vec();
        v.sort_by(f64::total_cmp);
        let n = v.len();
        if n == 0 {
            return Summary::default();
        }
        let median = if n % 2 == 1 {
            v[n / 2]
        } else {
            (v[n / 2 - 1] + v[n / 2]) / 2.0
        };
        Summary {
            n,
            median,
            min: v[0],
            max: v[n - 1],
        }
    }
}

/// The order variants run in within a round.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Order {
    /// The same order every round: A B C, A B C, ...
    Fixed,
    /// Each round starts one variant later: A B C, B C A, C A B, ... so no variant always
    /// sits at the same position; each still follows the same predecessor.
    Rotate,
    /// A new order each round, from a fixed-seed shuffle, so each variant follows different
    /// predecessors and sits at different times after their frees (the default: on this
    /// machine, what the variant before freed, and when, decides much of a variant's time).
    #[default]
    Shuffle,
}

/// Seed of [`Order::Shuffle`], fixed so a run's order can be reproduced.
pub const SHUFFLE_SEED: u64 = 0x9e37_79b9_7f4a_7c15;

/// The order of `n` variants in `round` under `order`.
pub fn round_order(order: Order, n: usize, round: usize) -> Vec<usize> {
    let mut v: Vec<usize> = (0..n).collect();
    match order {
        Order::Fixed => {}
        Order::Rotate => v.rotate_left(round % n.max(1)),
        Order::Shuffle => {
            // xorshift64*, seeded per round; Fisher-Yates.
            let mut x = SHUFFLE_SEED ^ (round as u64 + 1).wrapping_mul(0x2545_f491_4f6c_dd1d);
            for i in (1..n).rev() {
                x ^= x >> 12;
                x ^= x << 25;
                x ^= x >> 27;
                let j = (x.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 33) as usize % (i + 1);
                v.swap(i, j);
            }
        }
    }
    v
}

/// `/sys/kernel/mm/transparent_hugepage/enabled`, as the kernel shows it (the whole line,
/// as results have always recorded it), from the host's facts.
pub fn thp_mode() -> String {
    let mode = guestmem::Host::read().thp_mode;
    const MODES: [&str; 3] = ["always", "madvise", "never"];
    if !MODES.contains(&mode.as_str()) {
        return mode; // "unknown": nothing to show around it
    }
    MODES
        .iter()
        .map(|m| {
            if *m == mode {
                format!("[{m}]")
            } else {
                m.to_string()
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The protocol every scenario follows: warm-up rounds (recorded, not summarised), then
/// measured rounds in which every variant runs once, in the order [`round_order`] gives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Protocol {
    /// Warm-up rounds.
    pub warmup: usize,
    /// Measured rounds.
    pub rounds: usize,
    /// The order of variants within a round.
    pub order: Order,
}

/// Where a sample sat in the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Position {
    /// Round number, warm-ups first.
    pub round: usize,
    /// Position within its round (0 first).
    pub position: usize,
    /// Whether this was a warm-up round (not summarised).
    pub warmup: bool,
}

/// One measurement and where it sat.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Sampled<T> {
    /// Where it sat in the protocol.
    #[serde(flatten)]
    pub at: Position,
    /// What was measured.
    #[serde(flatten)]
    pub sample: T,
}

impl Protocol {
    /// Refuses a protocol that would measure nothing (no measured round), naming `scenario`.
    pub fn validate(&self, scenario: &'static str) -> Result<(), crate::LabError> {
        if self.rounds == 0 {
            return Err(crate::LabError::Config {
                scenario,
                reason: "rounds must be at least 1: warm-up rounds are not summarised".into(),
            });
        }
        Ok(())
    }

    /// Runs `measure(variant)` for every variant of `variants`, round by round; returns each
    /// variant's samples, warm-ups included, in run order.
    pub fn run<T, E>(
        &self,
        variants: usize,
        mut measure: impl FnMut(usize) -> Result<T, E>,
    ) -> Result<Vec<Vec<Sampled<T>>>, E> {
        let mut out: Vec<Vec<Sampled<T>>> = (0..variants).map(|_| Vec::new()).collect();
        for round in 0..self.warmup + self.rounds {
            for (position, i) in round_order(self.order, variants, round)
                .into_iter()
                .enumerate()
            {
                let sample = measure(i)?;
                out[i].push(Sampled {
                    at: Position {
                        round,
                        position,
                        warmup: round < self.warmup,
                    },
                    sample,
                });
            }
        }
        Ok(out)
    }
}

/// The summary of `f` over the measured (not warm-up) samples.
pub fn summarise<T>(samples: &[Sampled<T>], f: impl Fn(&T) -> f64) -> Summary {
    let v: Vec<f64> = samples
        .iter()
        .filter(|s| !s.at.warmup)
        .map(|s| f(&s.sample))
        .collect();
    Summary::of(&v)
}

/// `a / b`, or 0 when `b` is 0 (a ratio of medians in a report).
pub fn ratio(a: f64, b: f64) -> f64 {
    if b > 0.0 {
        a / b
    } else {
        0.0
    }
}

/// Runs `f` with `dir` made as its scratch folder, and removes the folder afterwards
/// whatever `f` returned (a scenario's images, memory files and sockets), or when the run
/// is stopped by a signal meanwhile ([`crate::stop`]).
pub fn in_work_dir<T>(
    dir: &std::path::Path,
    f: impl FnOnce() -> Result<T, crate::LabError>,
) -> Result<T, crate::LabError> {
    let _tracked = crate::stop::Tracked::new(dir);
    std::fs::create_dir_all(dir).map_err(|source| crate::LabError::Write {
        path: dir.to_path_buf(),
        source,
    })?;
    let r = f();
    let _ = std::fs::remove_dir_all(dir);
    r
}

/// Bytes free to an unprivileged user on the filesystem of `dir`.
pub fn free_bytes(dir: &std::path::Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(dir.as_os_str().as_bytes()).ok()?;
    let mut st = std::mem::MaybeUninit::<libc::statvfs>::uninit();
    // SAFETY: `c` is a NUL-terminated path and `st` room for the one struct statvfs fills.
    if unsafe { libc::statvfs(c.as_ptr(), st.as_mut_ptr()) } != 0 {
        return None;
    }
    // SAFETY: statvfs returned 0, so it filled `st`.
    let st = unsafe { st.assume_init() };
    Some(st.f_bavail.saturating_mul(st.f_frsize))
}

/// Touches `bytes` of fresh memory, a byte a page, and frees it: the memory a timed part
/// is about to take is then backed by this machine's host again. The host takes back memory
/// a second or two after it is freed (free page reporting), and a first touch after that
/// costs it several times a normal fault; a variant with a long untimed set-up (filling a
/// cache, say) would otherwise pay that in its timed part, and one without would not.
pub fn rebacked(bytes: usize) {
    let page = 4096;
    let mut v: Vec<u8> = Vec::with_capacity(bytes);
    let p = v.spare_capacity_mut();
    for i in (0..p.len()).step_by(page) {
        p[i].write(1);
    }
    // Not optimised away: the writes go through a pointer that escapes.
    std::hint::black_box(&mut v);
}

/// CPUs this process may run on.
pub fn available_cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// Turns a profiler's recording on (`true`) or off around a timed part, where
/// `GUESTMEM_LAB_PERF_CTL` names the control FIFO of a `perf record -D -1 --control
/// fifo:CTL` started beside the lab: a profile of the timed parts alone, not of the set-up
/// (a push, a cache's fill) around them. Unset, or no profiler reading the FIFO: nothing. The
/// object-store scenario also ends the window once the working set is read where
/// `GUESTMEM_LAB_PERF_PHASE=ws` (docs/object-storage.md, "Profiling a timed part").
pub fn profile_window(on: bool) {
    let Some(ctl) = std::env::var_os("GUESTMEM_LAB_PERF_CTL") else {
        return;
    };
    let cmd: &[u8] = if on { b"enable\n" } else { b"disable\n" };
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    // Not blocking: a FIFO no profiler reads is not opened (ENXIO), not waited on.
    let opened = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(ctl);
    if let Ok(mut f) = opened {
        let _ = f.write_all(cmd);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn prepare_out_creates_the_folder_but_never_its_parents() {
        let top = std::env::temp_dir().join(format!("guestmem-out-{}", std::process::id()));
        let deep = top.join("a").join("b");
        let e = prepare_out(&deep).unwrap_err();
        assert!(
            e.to_string().contains("parent folder does not exist"),
            "{e}"
        );
        assert!(!top.exists(), "no parent was created");
        prepare_out(&top).unwrap();
        assert!(top.is_dir());
        prepare_out(&top).unwrap(); // an existing folder is fine
        let file = top.join("f");
        std::fs::write(&file, b"").unwrap();
        assert!(prepare_out(&file).is_err());
        std::fs::remove_dir_all(&top).unwrap();
    }

    #[test]
    fn utc_timestamp_known_dates_match() {
        assert_eq!(utc_timestamp(UNIX_EPOCH), "19700101T000000Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_210_096); // 2024-02-29 12:34:56
        assert_eq!(utc_timestamp(t), "20240229T123456Z");
    }

    #[test]
    fn summary_even_and_odd_counts_give_true_median() {
        assert_eq!(Summary::of(&[3.0, 1.0, 2.0]).median, 2.0);
        let s = Summary::of(&[4.0, 1.0, 2.0, 3.0]);
        assert_eq!((s.median, s.min, s.max, s.n), (2.5, 1.0, 4.0, 4));
        assert_eq!(Summary::of(&[]).n, 0);
    }

    #[test]
    fn round_order_is_a_permutation_and_shuffle_varies_predecessors() {
        let mut preds = std::collections::HashSet::new();
        for round in 0..9 {
            for order in [Order::Fixed, Order::Rotate, Order::Shuffle] {
                let mut v = round_order(order, 5, round);
                if order == Order::Shuffle {
                    let p = v.iter().position(|&x| x == 1).unwrap();
                    preds.insert(if p == 0 { None } else { Some(v[p - 1]) });
                }
                v.sort_unstable();
                assert_eq!(v, vec![0, 1, 2, 3, 4]);
            }
        }
        assert!(preds.len() >= 3, "variant 1 followed only {preds:?}");
        assert_eq!(round_order(Order::Rotate, 3, 1), vec![1, 2, 0]);
    }
}
