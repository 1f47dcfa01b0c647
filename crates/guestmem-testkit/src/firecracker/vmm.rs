//! Driving a real Firecracker process: its API over its unix socket (one hand-written
//! HTTP/1.1 request a connection, as `curl --unix-socket` sends), its serial console's
//! output read line by line on a thread, bytes written to its serial input, and the process
//! killed and reaped when the [`Vmm`] is dropped. Also what a run needs around it: the
//! shared build's folder, whether this host can run it, the shared guest built with another
//! region size, and waiting for a page handler's socket to listen.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::ChildGuard as Reaped;

/// How long a fresh process has to create its API socket.
const API_SOCKET_WAIT: Duration = Duration::from_secs(20);
/// How long one API request may take (a `snapshot/load` waits on its page server).
const API_TIMEOUT: Duration = Duration::from_secs(300);

/// The shared Firecracker build (`../shared/firecracker` beside the workspace): the VMM, its
/// two example page handlers, the guest and its source.
pub fn shared_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/firecracker")
}

/// Why this host cannot run a Firecracker VM restored through userfaultfd, if it cannot:
/// no usable `/dev/kvm`, or no userfaultfd.
pub fn host_unavailable() -> Option<String> {
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Some("no usable /dev/kvm".into());
    }
    // SAFETY: flags only; the descriptor is closed at once.
    let fd = unsafe { libc::syscall(libc::SYS_userfaultfd, libc::O_CLOEXEC) };
    if fd < 0 {
        return Some("userfaultfd unavailable (needs root)".into());
    }
    // SAFETY: our own descriptor, closed once.
    unsafe { libc::close(fd as i32) };
    None
}

/// Why [`build_guest`] cannot run here, if it cannot (gcc or ld missing).
pub fn guest_toolchain_missing() -> Option<String> {
    ["gcc", "ld"]
        .into_iter()
        .find(|tool| Command::new(tool).arg("--version").output().is_err())
        .map(|tool| format!("{tool} is not installed (the guest is built from source)"))
}

/// Builds the shared guest (`guest.S`, `guest.ld` in `src`) with a `region_mb` MiB region
/// into `out/guest.elf`, as the shared README says; returns its path.
pub fn build_guest(src: &Path, out: &Path, region_mb: u64) -> io::Result<PathBuf> {
    build(src, out, "guest", &[format!("-DREGION_MB={region_mb}")])
}

/// `src/guest.S` assembled with `defines` and linked by `src/guest.ld` into
/// `out/<name>.elf`, as the shared README says.
fn build(src: &Path, out: &Path, name: &str, defines: &[String]) -> io::Result<PathBuf> {
    let obj = out.join(format!("{name}.o"));
    let elf = out.join(format!("{name}.elf"));
    let run = |cmd: &mut Command, what: &str| match cmd.status()?.success() {
        true => Ok(()),
        false => Err(io::Error::other(format!("{what} failed"))),
    };
    run(
        Command::new("gcc")
            .args(defines)
            .arg("-c")
            .arg(src.join("guest.S"))
            .arg("-o")
            .arg(&obj),
        "gcc on guest.S",
    )?;
    run(
        Command::new("ld")
            .args(["-m", "elf_x86_64", "-static", "-nostdlib"])
            .args(["-z", "max-page-size=0x1000", "-z", "noexecstack"])
            .args(["--build-id=none", "--no-warn-rwx-segments", "-T"])
            .arg(src.join("guest.ld"))
            .arg("-o")
            .arg(&elf)
            .arg(&obj),
        "ld",
    )?;
    Ok(elf)
}

/// Builds guestmem's copy of the guest (`crates/guestmem-testkit/guest/guest.S`: the shared
/// one, plus `w`, which writes `dirty_mb` MiB of the region with another pattern, for
/// diffs and moves) with a `region_mb` MiB region into `out/guest.elf`; returns its path.
/// `region_mb / dirty_mb` must be a power of two.
pub fn build_move_guest(out: &Path, region_mb: u64, dirty_mb: u64) -> io::Result<PathBuf> {
    assert!(
        dirty_mb > 0
            && (region_mb / dirty_mb).is_power_of_two()
            && region_mb.is_multiple_of(dirty_mb),
        "region {region_mb} MiB, dirty {dirty_mb} MiB: the ratio must be a power of two"
    );
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("guest");
    build(
        &src,
        out,
        "guest-move",
        &[
            format!("-DREGION_MB={region_mb}"),
            format!("-DDIRTY_MB={dirty_mb}"),
        ],
    )
}

/// Waits until a unix socket is bound at `path` and listening (from `/proc/net/unix`), at
/// most `limit`: a page handler that binds before it listens refuses a connect in between,
/// and probing it with a connect would take its one connection.
pub fn wait_listening(path: &Path, limit: Duration) -> io::Result<()> {
    /// `__SO_ACCEPTCON` in `/proc/net/unix`'s flags: the socket listens.
    const LISTENING: u32 = 1 << 16;
    let name = path.display().to_string();
    let t = Instant::now();
    loop {
        let table = std::fs::read_to_string("/proc/net/unix")?;
        let listening = table.lines().skip(1).any(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() >= 8
                && f[7] == name
                && u32::from_str_radix(f[3], 16).is_ok_and(|flags| flags & LISTENING != 0)
        });
        if listening {
            return Ok(());
        }
        if t.elapsed() > limit {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("nothing listens at {name} after {limit:?}"),
            ));
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// The guest-physical addresses of the 4 KiB pages at which two memory files (a VM's memory
/// as Firecracker writes it, page `i` at offset `i * 4096`) differ, in order; a page past
/// the shorter file's end counts as differing. Read a MiB at a time.
pub fn pages_differing(a: &Path, b: &Path) -> io::Result<Vec<u64>> {
    const PAGE: usize = 4096;
    let (mut fa, mut fb) = (std::fs::File::open(a)?, std::fs::File::open(b)?);
    let (la, lb) = (fa.metadata()?.len(), fb.metadata()?.len());
    let mut out = Vec::new();
    let (mut ba, mut bb) = (vec![0u8; 1 << 20], vec![0u8; 1 << 20]);
    let mut at = 0u64;
    while at < la.min(lb) {
        let n = ((la.min(lb) - at) as usize).min(ba.len());
        fa.read_exact(&mut ba[..n])?;
        fb.read_exact(&mut bb[..n])?;
        for (k, (pa, pb)) in ba[..n].chunks(PAGE).zip(bb[..n].chunks(PAGE)).enumerate() {
            if pa != pb {
                out.push(at + (k * PAGE) as u64);
            }
        }
        at += n as u64;
    }
    let mut past = la.min(lb).next_multiple_of(PAGE as u64);
    while past < la.max(lb) {
        out.push(past);
        past += PAGE as u64;
    }
    Ok(out)
}

/// Where the shared guest's region starts (guest.S's `REGION_BASE`).
pub const GUEST_REGION_BASE: u64 = 64 << 20;
/// Where the shared guest's program is loaded (guest.ld).
pub const GUEST_IMAGE: u64 = 16 << 20;

/// What is wrong with a VM's memory against its base's, given the pages at which the two
/// differ (`differ`, from [`pages_differing`]): in its `region_mib` MiB region exactly
/// `written` pages may differ (those its guest wrote); outside it only the low MiB (boot
/// structures, the hypervisor's own pages) and the guest program's image (its data and
/// its stack), which the running guest and its hypervisor write themselves. `None` when
/// nothing is.
pub fn stray_pages(differ: &[u64], region_mib: u64, written: u64) -> Option<String> {
    let region = GUEST_REGION_BASE..GUEST_REGION_BASE + (region_mib << 20);
    let live = |p: u64| p < 1 << 20 || (GUEST_IMAGE..GUEST_IMAGE + (1 << 20)).contains(&p);
    let in_region = differ.iter().filter(|p| region.contains(p)).count() as u64;
    let wrong: Vec<String> = differ
        .iter()
        .filter(|&&p| !region.contains(&p) && !live(p))
        .map(|p| format!("{p:#x}"))
        .collect();
    match (in_region == written, wrong.is_empty()) {
        (true, true) => None,
        _ => Some(format!(
            "{in_region} pages of the region not the base's (the guest wrote {written}), and \
             {} outside it: {:?}",
            wrong.len(),
            &wrong[..wrong.len().min(8)]
        )),
    }
}

/// Where a restored VM's memory comes from (`snapshot/load`'s `mem_backend`).
#[derive(Debug, Clone, Copy)]
pub enum Backend<'a> {
    /// The memory file, mapped by Firecracker itself.
    File(&'a Path),
    /// A page server listening on this socket.
    Uffd(&'a Path),
}

/// A Firecracker process: its API socket, its serial console's input and output lines.
/// Dropping it kills and reaps the process and removes its API socket.
#[derive(Debug)]
pub struct Vmm {
    proc: Reaped,
    api: PathBuf,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Vmm {
    /// Starts `bin` with its API socket at `dir/<name>.api.sock` (a name no other live
    /// process uses) and waits for the socket.
    pub fn start(bin: &Path, dir: &Path, name: &str) -> io::Result<Vmm> {
        let api = dir.join(format!("{name}.api.sock"));
        let _ = std::fs::remove_file(&api);
        let mut child = Command::new(bin)
            .arg("--api-sock")
            .arg(&api)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let stdin = child.stdin.take().expect("piped");
        let stdout = child.stdout.take().expect("piped");
        let proc = Reaped::new(child);
        let (tx, lines) = mpsc::channel();
        std::thread::Builder::new()
            .name(format!("{name}-console"))
            .spawn(move || {
                for line in BufReader::new(stdout).lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })?;
        let mut vmm = Vmm {
            proc,
            api,
            stdin,
            lines,
        };
        let t = Instant::now();
        while !vmm.api.exists() {
            if let Ok(Some(st)) = vmm.proc.try_status() {
                return Err(io::Error::other(format!("firecracker exited: {st}")));
            }
            if t.elapsed() > API_SOCKET_WAIT {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no API socket at {}", vmm.api.display()),
                ));
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        // The socket's file appears at bind, before Firecracker listens: a request in
        // between is refused (seen on a loaded host).
        wait_listening(&vmm.api, API_SOCKET_WAIT.saturating_sub(t.elapsed()))?;
        Ok(vmm)
    }

    /// Its pid.
    pub fn pid(&self) -> u32 {
        self.proc.id()
    }

    /// One API request; the HTTP status and body, or the error if the VMM went away.
    pub fn call(&self, method: &str, path: &str, body: &str) -> io::Result<(u16, String)> {
        let mut s = UnixStream::connect(&self.api)?;
        s.set_read_timeout(Some(API_TIMEOUT))?;
        write!(
            s,
            "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n\
             Accept: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )?;
        let mut reader = BufReader::new(s);
        let mut status = String::new();
        reader.read_line(&mut status)?;
        let code = status
            .split_whitespace()
            .nth(1)
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| io::Error::other(format!("bad status line {status:?}")))?;
        let mut len = 0usize;
        loop {
            let mut h = String::new();
            reader.read_line(&mut h)?;
            if h.trim().is_empty() {
                break;
            }
            if let Some(v) = h.to_ascii_lowercase().strip_prefix("content-length:") {
                len = v.trim().parse().unwrap_or(0);
            }
        }
        let mut b = vec![0u8; len];
        reader.read_exact(&mut b)?;
        Ok((code, String::from_utf8_lossy(&b).into_owned()))
    }

    /// One API request that must succeed (a 2xx status); its body.
    pub fn ok(&self, method: &str, path: &str, body: &str) -> io::Result<String> {
        match self.call(method, path, body)? {
            (200..=299, text) => Ok(text),
            (code, text) => Err(io::Error::other(format!(
                "{method} {path}: HTTP {code}: {text}"
            ))),
        }
    }

    /// Boots `kernel` with `mem_mib` MiB on one vCPU, in 2 MiB hugetlb pages when `huge`.
    pub fn boot(&self, kernel: &Path, mem_mib: u64, huge: bool) -> io::Result<()> {
        self.ok(
            "PUT",
            "/boot-source",
            &format!(
                r#"{{"kernel_image_path": "{}", "boot_args": "console=ttyS0 reboot=k panic=1"}}"#,
                kernel.display()
            ),
        )?;
        let pages = if huge { r#", "huge_pages": "2M""# } else { "" };
        self.ok(
            "PUT",
            "/machine-config",
            &format!(r#"{{"vcpu_count": 1, "mem_size_mib": {mem_mib}{pages}}}"#),
        )?;
        self.ok("PUT", "/actions", r#"{"action_type": "InstanceStart"}"#)
            .map(drop)
    }

    /// Pauses the VM and writes a full snapshot: its state to `vmstate`, its memory to `mem`.
    pub fn snapshot(&self, vmstate: &Path, mem: &Path) -> io::Result<()> {
        self.ok("PATCH", "/vm", r#"{"state": "Paused"}"#)?;
        self.ok(
            "PUT",
            "/snapshot/create",
            &format!(
                r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
                vmstate.display(),
                mem.display()
            ),
        )
        .map(drop)
    }

    /// `snapshot/load`'s request body: `vmstate` restored from `backend`, resumed.
    pub fn load_body(vmstate: &Path, backend: Backend<'_>) -> String {
        let (kind, path) = match backend {
            Backend::File(p) => ("File", p),
            Backend::Uffd(p) => ("Uffd", p),
        };
        format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "{kind}", "backend_path": "{}"}}, "resume_vm": true}}"#,
            vmstate.display(),
            path.display()
        )
    }

    /// Restores `vmstate` from `backend` into this (fresh) process with KVM's dirty-page
    /// tracking on (so that a `Diff` snapshot holds exactly what the guest wrote since),
    /// and resumes it.
    pub fn load_tracked(&self, vmstate: &Path, backend: Backend<'_>) -> io::Result<()> {
        let body = Vmm::load_body(vmstate, backend).replace(
            r#""resume_vm": true"#,
            r#""track_dirty_pages": true, "resume_vm": true"#,
        );
        self.ok("PUT", "/snapshot/load", &body).map(drop)
    }

    /// Its API socket.
    pub fn api(&self) -> &Path {
        &self.api
    }

    /// Restores `vmstate` from `backend` into this (fresh) process and resumes it.
    pub fn load(&self, vmstate: &Path, backend: Backend<'_>) -> io::Result<()> {
        self.ok("PUT", "/snapshot/load", &Vmm::load_body(vmstate, backend))
            .map(drop)
    }

    /// Waits at most `limit` for a console line starting with `prefix`, skipping others.
    pub fn line(&self, prefix: &str, limit: Duration) -> io::Result<String> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return Ok(l),
                Ok(_) => {}
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    return Err(io::Error::new(
                        io::ErrorKind::TimedOut,
                        format!("no {prefix:?} line from the guest within {limit:?}"),
                    ))
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(io::Error::other(format!(
                        "firecracker closed its console before a {prefix:?} line"
                    )))
                }
            }
        }
    }

    /// Writes `key` to the guest's serial input.
    pub fn send(&mut self, key: u8) -> io::Result<()> {
        self.stdin.write_all(&[key])?;
        self.stdin.flush()
    }

    /// Waits at most `limit` for the process to exit by itself.
    pub fn wait_exit(&mut self, limit: Duration) -> io::Result<ExitStatus> {
        self.proc.wait_within(limit)
    }
}

impl Drop for Vmm {
    fn drop(&mut self) {
        // The process first (its guard's own drop would come after this), then its socket.
        self.proc.kill();
        let _ = std::fs::remove_file(&self.api);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stray_pages_takes_the_written_pages_and_the_guests_own_and_nothing_else() {
        // A 4 MiB region with 1 MiB written, and the pages the running guest and its
        // hypervisor write: the low MiB and the program's image.
        let written: Vec<u64> = (0..256).map(|k| GUEST_REGION_BASE + k * 16384).collect();
        let mut differ = vec![0xde000, 0xdf000, GUEST_IMAGE, GUEST_IMAGE + 0x4000];
        differ.extend(&written);
        assert_eq!(stray_pages(&differ, 4, 256), None);
        // A page not the base's above the region, below it, past the program's image.
        for stray in [
            GUEST_REGION_BASE + (4 << 20),
            2 << 20,
            GUEST_IMAGE + (1 << 20),
        ] {
            let mut d = differ.clone();
            d.push(stray);
            d.sort();
            let why = stray_pages(&d, 4, 256).expect("a stray page");
            assert!(why.contains(&format!("{stray:#x}")), "{why}");
        }
        // A written page that reads as the base's (a diff's page lost), or one too many;
        // a region nothing wrote that differs.
        assert!(stray_pages(&differ[..differ.len() - 1], 4, 256).is_some());
        let mut d = differ.clone();
        d.push(GUEST_REGION_BASE + 4096);
        assert!(stray_pages(&d, 4, 256).is_some());
        assert!(stray_pages(&differ, 4, 0).is_some());
    }

    #[test]
    fn pages_differing_names_each_page_that_differs_and_those_past_the_shorter_file() {
        let dir = crate::Scratch::new("pages-differing");
        let (a, b) = (dir.join("a"), dir.join("b"));
        let mut x = vec![0u8; 5 << 20];
        std::fs::write(&a, &x).unwrap();
        x[4096 + 7] = 1;
        x[(3 << 20) + 4095] = 2;
        x.truncate((4 << 20) + 8192);
        std::fs::write(&b, &x).unwrap();
        let d = pages_differing(&a, &b).unwrap();
        let past: Vec<u64> = ((4 << 20) + 8192..5 << 20).step_by(4096).collect();
        assert_eq!(d[..2], [4096, 3 << 20]);
        assert_eq!(d[2..], past[..]);
    }
}
