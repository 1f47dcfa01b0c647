//! `guestmem serve-uffd` against real Firecracker (`../shared/firecracker/`): a guest booted,
//! filled with a pattern, snapshotted, restored through the page server and checked page by
//! page by the guest itself; and a server that must refuse the VM after it connected (its
//! memory file shorter than the VM's memory) ending the real VMM through its pidfd instead of
//! leaving its `snapshot/load` waiting for ever.
//!
//! The guest is the shared one (`guest.S`), rebuilt here with a 64 MiB region so the fill
//! takes seconds on this emulating KVM. Skipped, with the reason, where Firecracker, its guest
//! source, `/dev/kvm`, userfaultfd or gcc and ld are missing.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ChildStdin, Command, Stdio};

use guestmem_testkit::{ChildGuard as Guard, Scratch};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// The guest's region, MiB (the shared build uses 512).
const REGION_MB: u64 = 64;
/// The VM's memory, MiB: the region starts at 64 MiB.
const MEM_MIB: u64 = 192;

fn shared() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/firecracker")
}

/// Why Firecracker cannot be run here, if it cannot.
fn missing() -> Option<String> {
    let fc = shared().join("firecracker");
    if !fc.exists() {
        return Some(format!("no Firecracker build at {}", fc.display()));
    }
    if !shared().join("guest.S").exists() {
        return Some("no guest source (guest.S) beside it".into());
    }
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
    for tool in ["gcc", "ld"] {
        if Command::new(tool).arg("--version").output().is_err() {
            return Some(format!(
                "{tool} is not installed (the guest is built from source)"
            ));
        }
    }
    None
}

/// Its stderr, once it has exited.
fn stderr(g: &mut Guard) -> String {
    let mut s = String::new();
    if let Some(mut e) = g.child().stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// Builds the shared guest with a `REGION_MB` region into `dir`.
fn build_guest(dir: &Path) -> PathBuf {
    let obj = dir.join("guest.o");
    let elf = dir.join("guest.elf");
    let ok = Command::new("gcc")
        .arg(format!("-DREGION_MB={REGION_MB}"))
        .arg("-c")
        .arg(shared().join("guest.S"))
        .arg("-o")
        .arg(&obj)
        .status()
        .unwrap()
        .success();
    assert!(ok, "gcc failed on guest.S");
    let ok = Command::new("ld")
        .args([
            "-m",
            "elf_x86_64",
            "-static",
            "-nostdlib",
            "-z",
            "max-page-size=0x1000",
        ])
        .args([
            "-z",
            "noexecstack",
            "--build-id=none",
            "--no-warn-rwx-segments",
            "-T",
        ])
        .arg(shared().join("guest.ld"))
        .arg("-o")
        .arg(&elf)
        .arg(&obj)
        .status()
        .unwrap()
        .success();
    assert!(ok, "ld failed on guest.o");
    elf
}

/// A Firecracker process: its API socket, its serial console's input and output lines.
struct Firecracker {
    proc: Guard,
    api: PathBuf,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
}

impl Firecracker {
    fn start(dir: &Path, name: &str) -> Firecracker {
        let api = dir.join(format!("{name}.api.sock"));
        let _ = std::fs::remove_file(&api);
        let mut child = Command::new(shared().join("firecracker"))
            .arg("--api-sock")
            .arg(&api)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let t = Instant::now();
        while !api.exists() {
            assert!(t.elapsed() < Duration::from_secs(20), "no API socket");
            std::thread::sleep(Duration::from_millis(10));
        }
        Firecracker {
            proc: Guard::new(child),
            api,
            stdin,
            lines,
        }
    }

    /// One API request; the HTTP status and body, or the error if the VMM went away.
    fn call(&self, method: &str, path: &str, body: &str) -> std::io::Result<(u16, String)> {
        let mut s = UnixStream::connect(&self.api)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
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
            .ok_or_else(|| std::io::Error::other(format!("bad status line {status:?}")))?;
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

    fn ok(&self, method: &str, path: &str, body: &str) {
        let (code, text) = self.call(method, path, body).unwrap();
        assert!((200..300).contains(&code), "{method} {path}: {code} {text}");
    }

    /// Waits for a console line starting with `prefix`.
    fn line(&self, prefix: &str, secs: u64) -> String {
        let deadline = Instant::now() + Duration::from_secs(secs);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(l) if l.starts_with(prefix) => return l,
                Ok(_) => {}
                Err(_) => panic!("no {prefix:?} line from the guest within {secs} s"),
            }
        }
    }

    fn send(&mut self, key: u8) {
        self.stdin.write_all(&[key]).unwrap();
        self.stdin.flush().unwrap();
    }
}

/// Starts `guestmem serve-uffd` on `socket` for `mem` and waits for its socket.
fn serve(socket: &Path, mem: &Path) -> Guard {
    let child = Command::new(env!("CARGO_BIN_EXE_guestmem"))
        .arg("serve-uffd")
        .arg("--once")
        .arg("--socket")
        .arg(socket)
        .arg("--mem-file")
        .arg(mem)
        .args(["--threads", "2"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut g = Guard::new(child);
    let t = Instant::now();
    while !socket.exists() {
        assert!(
            g.running(),
            "the server exited before listening: {}",
            stderr(&mut g)
        );
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

#[test]
fn real_firecracker_restores_through_serve_uffd_and_is_ended_when_it_cannot_be_served() {
    if let Some(why) = missing() {
        guestmem_testkit::skip(format_args!("{why}"));
        return;
    }
    let dir = Scratch::new("firecracker");
    let guest = build_guest(&dir);

    // Boot, fill, snapshot.
    let (vmstate, mem) = (dir.join("snap.vmstate"), dir.join("snap.mem"));
    {
        let fc = Firecracker::start(&dir, "boot");
        fc.ok(
            "PUT",
            "/boot-source",
            &format!(
                r#"{{"kernel_image_path": "{}", "boot_args": "console=ttyS0 reboot=k panic=1"}}"#,
                guest.display()
            ),
        );
        fc.ok(
            "PUT",
            "/machine-config",
            &format!(r#"{{"vcpu_count": 1, "mem_size_mib": {MEM_MIB}}}"#),
        );
        fc.ok("PUT", "/actions", r#"{"action_type": "InstanceStart"}"#);
        fc.line("READY", 120);
        fc.ok("PATCH", "/vm", r#"{"state": "Paused"}"#);
        fc.ok(
            "PUT",
            "/snapshot/create",
            &format!(
                r#"{{"snapshot_type": "Full", "snapshot_path": "{}", "mem_file_path": "{}"}}"#,
                vmstate.display(),
                mem.display()
            ),
        );
    }
    let load = |backend: &Path| {
        format!(
            r#"{{"snapshot_path": "{}", "mem_backend": {{"backend_type": "Uffd", "backend_path": "{}"}}, "resume_vm": true}}"#,
            vmstate.display(),
            backend.display()
        )
    };

    // Restore through the page server: the guest touches every page and finds each right.
    let socket = dir.join("uffd.sock");
    let mut srv = serve(&socket, &mem);
    let mut fc = Firecracker::start(&dir, "restore");
    fc.ok("PUT", "/snapshot/load", &load(&socket));
    fc.send(b't');
    let touch = fc.line("TOUCH", 120);
    assert!(touch.ends_with(" BAD 0"), "{touch}");
    // And every qword, now that all is in.
    fc.send(b'g');
    let pass = fc.line("PASS", 120);
    assert!(pass.ends_with(" BAD 0"), "{pass}");
    drop(fc);
    let st = srv.wait_exit(20);
    let err = stderr(&mut srv);
    eprintln!("guest: {touch}, {pass}\nserver: {err}");
    assert!(st.success(), "{err}");
    assert!(
        err.contains(&format!("sent 1 regions ({MEM_MIB} MiB)")),
        "{err}"
    );

    // Two real Firecracker VMs at once through one fleet (no --once): each touches and
    // checks every page; SIGTERM graduates both (every block in, ranges unregistered), and
    // with the server gone each guest checks every qword again and finds it right.
    let fleet_socket = dir.join("fleet.sock");
    let mut fleet = Guard::new(
        Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .arg("serve-uffd")
            .arg("--socket")
            .arg(&fleet_socket)
            .arg("--mem-file")
            .arg(&mem)
            .args(["--threads", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !fleet_socket.exists() {
        assert!(fleet.running(), "the fleet exited: {}", stderr(&mut fleet));
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut vms: Vec<Firecracker> = ["fleet-a", "fleet-b"]
        .iter()
        .map(|n| Firecracker::start(&dir, n))
        .collect();
    for fc in &vms {
        fc.ok("PUT", "/snapshot/load", &load(&fleet_socket));
    }
    for fc in &mut vms {
        fc.send(b't');
    }
    for fc in &vms {
        let touch = fc.line("TOUCH", 120);
        assert!(touch.ends_with(" BAD 0"), "fleet: {touch}");
    }
    // SAFETY: kill on our own child's pid (not reaped yet).
    assert_eq!(unsafe { libc::kill(fleet.id() as i32, libc::SIGTERM) }, 0);
    let st = fleet.wait_exit(30);
    let err = stderr(&mut fleet);
    assert!(st.success(), "{err}");
    assert_eq!(err.matches("reason=\"Graduated\"").count(), 2, "{err}");
    for fc in &mut vms {
        fc.send(b'g');
    }
    for fc in &vms {
        let pass = fc.line("PASS", 120);
        assert!(pass.ends_with(" BAD 0"), "after graduation: {pass}");
    }
    drop(vms);

    // A memory file shorter than the VM's memory: refused after Firecracker connected, so
    // Firecracker is killed through its pidfd rather than left in snapshot/load for ever.
    let short = dir.join("short.mem");
    std::fs::copy(&mem, &short).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&short)
        .unwrap()
        .set_len(MEM_MIB << 19)
        .unwrap();
    let mut srv = serve(&socket, &short);
    let mut fc = Firecracker::start(&dir, "refused");
    let t = Instant::now();
    let r = fc.call("PUT", "/snapshot/load", &load(&socket));
    let st = fc.proc.wait_exit(30);
    assert_eq!(st.signal(), Some(libc::SIGKILL), "{st:?} (load said {r:?})");
    assert!(t.elapsed() < Duration::from_secs(30));
    let st = srv.wait_exit(20);
    let err = stderr(&mut srv);
    assert_eq!(st.code(), Some(1), "{err}");
    assert!(
        err.contains("killed the peer") && err.contains("but region 0"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}
