//! `guestmem serve-uffd` against real Firecracker (`../shared/firecracker/`): a guest booted,
//! filled with a pattern, snapshotted, restored through the page server and checked page by
//! page by the guest itself (from a file, from S3, two at once, and across a take-over by a
//! second server; from S3, every page of its memory by the host too); and a server that
//! must refuse the VM after it connected (its memory file shorter than the VM's memory)
//! ending the real VMM through its pidfd instead of leaving its `snapshot/load` waiting
//! for ever.
//!
//! The guest is the shared one (`guest.S`), rebuilt here with a 64 MiB region so the fill
//! takes seconds on this emulating KVM. Skipped, with the reason, where Firecracker, its guest
//! source, `/dev/kvm`, userfaultfd or gcc and ld are missing.

use std::io::Read;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem_testkit::firecracker::vmm::{self, Backend, Vmm};
use guestmem_testkit::{ChildGuard as Guard, Scratch};

/// The guest's region, MiB (the shared build uses 512).
const REGION_MB: u64 = 64;
/// The VM's memory, MiB: the region starts at 64 MiB.
const MEM_MIB: u64 = 192;
/// How long the guest has for a pass.
const PASS: Duration = Duration::from_secs(120);

fn firecracker() -> PathBuf {
    vmm::shared_dir().join("firecracker")
}

/// Why Firecracker cannot be run here, if it cannot.
fn missing() -> Option<String> {
    let fc = firecracker();
    if !fc.exists() {
        return Some(format!("no Firecracker build at {}", fc.display()));
    }
    if !vmm::shared_dir().join("guest.S").exists() {
        return Some("no guest source (guest.S) beside it".into());
    }
    vmm::host_unavailable().or_else(vmm::guest_toolchain_missing)
}

/// Its stderr, once it has exited.
fn stderr(g: &mut Guard) -> String {
    let mut s = String::new();
    if let Some(mut e) = g.child().stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// A fresh Firecracker process with its API socket in `dir`.
fn start(dir: &Path, name: &str) -> Vmm {
    Vmm::start(&firecracker(), dir, name).unwrap()
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
    let guest = vmm::build_guest(&vmm::shared_dir(), &dir, REGION_MB).unwrap();

    // Boot, fill, snapshot.
    let (vmstate, mem) = (dir.join("snap.vmstate"), dir.join("snap.mem"));
    {
        let fc = start(&dir, "boot");
        fc.boot(&guest, MEM_MIB, false).unwrap();
        fc.line("READY", PASS).unwrap();
        fc.snapshot(&vmstate, &mem).unwrap();
    }
    let load = |backend: &Path| Vmm::load_body(&vmstate, Backend::Uffd(backend));

    // Restore through the page server: the guest touches every page and finds each right.
    let socket = dir.join("uffd.sock");
    let mut srv = serve(&socket, &mem);
    let mut fc = start(&dir, "restore");
    fc.load(&vmstate, Backend::Uffd(&socket)).unwrap();
    fc.send(b't').unwrap();
    let touch = fc.line("TOUCH", PASS).unwrap();
    assert!(touch.ends_with(" BAD 0"), "{touch}");
    // And every qword, now that all is in.
    fc.send(b'g').unwrap();
    let pass = fc.line("PASS", PASS).unwrap();
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

    // The same snapshot pushed to S3 (a real server, in this process) and restored straight
    // from it through a cold frame cache: the guest touches every page and checks every
    // qword.
    {
        let s3 = guestmem_testkit::s3::S3Server::start("firecracker", &["snaps"]);
        let push = Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .args(["snapshot", "push"])
            .arg(&mem)
            .arg("s3://snaps/fc")
            .envs(s3.env())
            .output()
            .unwrap();
        assert!(
            push.status.success(),
            "{}",
            String::from_utf8_lossy(&push.stderr)
        );
        let s3_socket = dir.join("s3.sock");
        let mut srv = Guard::new(
            Command::new(env!("CARGO_BIN_EXE_guestmem"))
                .args(["serve-uffd", "--once", "--socket"])
                .arg(&s3_socket)
                .args(["--mem-file", "s3://snaps/fc", "--cache-dir"])
                .arg(dir.join("cache"))
                .envs(s3.env())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        );
        let t = Instant::now();
        while !s3_socket.exists() {
            assert!(srv.running(), "the server exited: {}", stderr(&mut srv));
            assert!(t.elapsed() < Duration::from_secs(30), "no socket appeared");
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut fc = start(&dir, "restore-s3");
        fc.load(&vmstate, Backend::Uffd(&s3_socket)).unwrap();
        fc.send(b't').unwrap();
        let touch = fc.line("TOUCH", PASS).unwrap();
        assert!(touch.ends_with(" BAD 0"), "{touch}");
        fc.send(b'g').unwrap();
        let pass = fc.line("PASS", PASS).unwrap();
        assert!(pass.ends_with(" BAD 0"), "{pass}");
        // And every page as the host sees it: the VM's memory written out whole (a Full
        // snapshot, which reads the pages the guest never touched through the server too)
        // is the pushed file's, but for the low MiB (boot structures, the hypervisor's own
        // pages) and the guest program's image (its data and its stack), which the running
        // guest and the hypervisor write themselves.
        let after = dir.join("after-s3.mem");
        fc.snapshot(&dir.join("after-s3.vmstate"), &after).unwrap();
        let differ = vmm::pages_differing(&mem, &after).unwrap();
        let stray = vmm::stray_pages(&differ, REGION_MB, 0);
        assert!(stray.is_none(), "{stray:?}");
        std::fs::remove_file(&after).unwrap();
        drop(fc);
        let st = srv.wait_exit(20);
        let err = stderr(&mut srv);
        eprintln!("from S3: guest: {touch}, {pass}\nserver: {err}");
        assert!(st.success(), "{err}");
    }

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
    let mut vms: Vec<Vmm> = ["fleet-a", "fleet-b"]
        .iter()
        .map(|n| start(&dir, n))
        .collect();
    for fc in &vms {
        fc.load(&vmstate, Backend::Uffd(&fleet_socket)).unwrap();
    }
    for fc in &mut vms {
        fc.send(b't').unwrap();
    }
    for fc in &vms {
        let touch = fc.line("TOUCH", PASS).unwrap();
        assert!(touch.ends_with(" BAD 0"), "fleet: {touch}");
    }
    // SAFETY: kill on our own child's pid (not reaped yet).
    assert_eq!(unsafe { libc::kill(fleet.id() as i32, libc::SIGTERM) }, 0);
    let st = fleet.wait_exit(30);
    let err = stderr(&mut fleet);
    assert!(st.success(), "{err}");
    assert_eq!(err.matches("reason=\"graduated\"").count(), 2, "{err}");
    for fc in &mut vms {
        fc.send(b'g').unwrap();
    }
    for fc in &vms {
        let pass = fc.line("PASS", PASS).unwrap();
        assert!(pass.ends_with(" BAD 0"), "after graduation: {pass}");
    }
    drop(vms);

    // A real Firecracker VM handed from one server to another (an upgrade): restored through
    // the first, faults only, so that nearly all its memory is still to come; a second
    // server takes over; the guest then touches every page and checks every qword, served
    // by the new server alone.
    let control = dir.join("control.sock");
    let upgrade = dir.join("upgrade.sock");
    let fleet = |extra: &[&str]| {
        Guard::new(
            Command::new(env!("CARGO_BIN_EXE_guestmem"))
                .arg("serve-uffd")
                .arg("--socket")
                .arg(&upgrade)
                .arg("--mem-file")
                .arg(&mem)
                .arg("--control")
                .arg(&control)
                .args(["--prefetch-threads", "0"])
                .args(extra)
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap(),
        )
    };
    let mut old = fleet(&[]);
    let t = Instant::now();
    while !upgrade.exists() || !control.exists() {
        assert!(old.running(), "the server exited: {}", stderr(&mut old));
        assert!(t.elapsed() < Duration::from_secs(20), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut fc = start(&dir, "upgrade");
    fc.load(&vmstate, Backend::Uffd(&upgrade)).unwrap();
    let mut new = fleet(&["--take-over", control.to_str().unwrap()]);
    let st = old.wait_exit(30);
    let err = stderr(&mut old);
    assert!(st.success(), "{err}");
    assert!(err.contains("handed 1 sockets and 1 VMs"), "{err}");
    fc.send(b't').unwrap();
    let touch = fc.line("TOUCH", PASS).unwrap();
    assert!(touch.ends_with(" BAD 0"), "after the take-over: {touch}");
    fc.send(b'g').unwrap();
    let pass = fc.line("PASS", PASS).unwrap();
    assert!(pass.ends_with(" BAD 0"), "after the take-over: {pass}");
    // SAFETY: kill on our own child's pid (not reaped yet).
    assert_eq!(unsafe { libc::kill(new.id() as i32, libc::SIGTERM) }, 0);
    let st = new.wait_exit(30);
    let err = stderr(&mut new);
    assert!(st.success(), "{err}");
    assert!(err.contains("took over 1 VMs"), "{err}");
    drop(fc);

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
    let mut fc = start(&dir, "refused");
    let t = Instant::now();
    let r = fc.call("PUT", "/snapshot/load", &load(&socket));
    let st = fc.wait_exit(Duration::from_secs(30)).unwrap();
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
