//! `guestmem move` and `guestmem move-in` with real Firecracker (`../shared/firecracker/`),
//! both hosts on this one: a VM restored from a snapshot in S3 (a real server started here)
//! with dirty-page tracking writes part of its memory, is moved to a second Firecracker
//! served by a second page server, and checks every qword there: the pages its diff brought
//! from the source and the ones the base brought from the store (the guest checks its
//! region; the host compares every other page of the VM's memory, written out whole, with
//! the base's). And a move the destination
//! refuses (it cannot read the base) leaves the VM running on the source, whole.
//!
//! The guest is guestmem's copy of the shared one (its `w` writes DIRTY_MB MiB). Skipped,
//! with the reason, where Firecracker, `/dev/kvm`, userfaultfd or gcc and ld are missing.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use guestmem_testkit::firecracker::vmm::{self, Backend, Vmm};
use guestmem_testkit::s3::S3Server;
use guestmem_testkit::{ChildGuard as Guard, Scratch};

/// The guest's region, MiB.
const REGION_MB: u64 = 64;
/// What `w` writes, MiB (runs of 16 pages spread over the region).
const DIRTY_MB: u64 = 16;
/// The VM's memory, MiB: the region starts at 64 MiB.
const MEM_MIB: u64 = 192;
/// How long the guest has for a pass.
const PASS: Duration = Duration::from_secs(120);

fn firecracker() -> PathBuf {
    vmm::shared_dir().join("firecracker")
}

fn missing() -> Option<String> {
    let fc = firecracker();
    if !fc.exists() {
        return Some(format!("no Firecracker build at {}", fc.display()));
    }
    vmm::host_unavailable()
        .or_else(vmm::guest_toolchain_missing)
        // The moves' work dirs are under the temporary folder: a Diff there keeps its
        // holes page by page, or the move refuses before it pauses.
        .or_else(|| {
            guestmem::store::check_diff_folder(&std::env::temp_dir())
                .err()
                .map(|e| e.to_string())
        })
}

fn guestmem() -> Command {
    Command::new(env!("CARGO_BIN_EXE_guestmem"))
}

fn stderr(g: &mut Guard) -> String {
    let mut s = String::new();
    if let Some(mut e) = g.child().stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// A page server of `url` on `socket`, for one VM, with its own cache.
fn serve_from_store(s3: &S3Server, socket: &Path, url: &str, cache: &Path) -> Guard {
    let mut g = Guard::new(
        guestmem()
            .args(["serve-uffd", "--once", "--socket"])
            .arg(socket)
            .args(["--mem-file", url, "--cache-dir"])
            .arg(cache)
            .envs(s3.env())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let t = Instant::now();
    while !socket.exists() {
        assert!(g.running(), "the server exited: {}", stderr(&mut g));
        assert!(t.elapsed() < Duration::from_secs(30), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

/// `guestmem move` of the VM at `dir`'s `src.api.sock` to `addr` with the move key in
/// `key`, as `moved`: what it did, and its stderr.
fn move_out(
    dir: &Path,
    key: &Path,
    addr: &str,
    env: &[(&'static str, String)],
) -> (std::process::Output, String) {
    let out = guestmem()
        .args(["move", "--api"])
        .arg(dir.join("src.api.sock"))
        .arg("--key-file")
        .arg(key)
        .args(["--base", "s3://snaps/base", "--as", "moved", "--to", addr])
        .args(["--listen", "127.0.0.1:0", "--work-dir"])
        .arg(dir.join("work"))
        .envs(env.iter().cloned())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out, err)
}

/// A move key file in `dir` named `name`, only its owner may read it, of `secret`.
fn key_file(dir: &Path, name: &str, secret: u8) -> std::path::PathBuf {
    use std::os::unix::fs::OpenOptionsExt;
    let p = dir.join(name);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&p)
        .unwrap();
    f.write_all(&[secret; 32]).unwrap();
    p
}

/// `guestmem move-in` for the Firecracker at `api`, on a free port of 127.0.0.1, with the
/// move key in `key`; the process and the address it listens on.
fn move_in(env: &[(&'static str, String)], api: &Path, dir: &Path, key: &Path) -> (Guard, String) {
    let mut g = Guard::new(
        guestmem()
            .args(["move-in", "--listen", "127.0.0.1:0", "--api"])
            .arg(api)
            .arg("--key-file")
            .arg(key)
            .arg("--dir")
            .arg(dir.join("in"))
            .arg("--cache-dir")
            .arg(dir.join("cache-in"))
            .args(["--wait", "60", "--fetch-deadline", "10"])
            .envs(env.iter().cloned())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let mut err = BufReader::new(g.child().stderr.take().unwrap());
    // Its log lines may come first (a cache's warning, say).
    let mut said = String::new();
    let addr = loop {
        let mut line = String::new();
        if err.read_line(&mut line).unwrap() == 0 {
            panic!("move-in said {said:?}");
        }
        if let Some(a) = line.trim().strip_prefix("waiting for a move on ") {
            break a.to_string();
        }
        said.push_str(&line);
    };
    // The rest of its stderr, drained so that it never blocks on a full pipe.
    let rest = std::thread::spawn(move || {
        let mut s = String::new();
        let _ = err.read_to_string(&mut s);
        s
    });
    std::mem::forget(rest);
    (g, addr)
}

/// Boots the guest, fills it, snapshots it (Full), pushes it to `s3://snaps/base`; the
/// vmstate's path (the memory file stays beside it, `base.mem`).
fn base_in_store(dir: &Path, s3: &S3Server) -> PathBuf {
    let guest = vmm::build_move_guest(dir, REGION_MB, DIRTY_MB).unwrap();
    let (vmstate, mem) = (dir.join("base.vmstate"), dir.join("base.mem"));
    {
        let fc = Vmm::start(&firecracker(), dir, "boot").unwrap();
        fc.boot(&guest, MEM_MIB, false).unwrap();
        fc.line("READY", PASS).unwrap();
        fc.snapshot(&vmstate, &mem).unwrap();
    }
    let push = guestmem()
        .args(["snapshot", "push"])
        .arg(&mem)
        .arg("s3://snaps/base")
        .envs(s3.env())
        .output()
        .unwrap();
    assert!(
        push.status.success(),
        "{}",
        String::from_utf8_lossy(&push.stderr)
    );
    vmstate
}

/// The VM restored from the base in the store, tracking dirty pages, and its dirty pages
/// written; its page server and the VM.
fn source_vm(dir: &Path, s3: &S3Server, vmstate: &Path, name: &str) -> (Guard, Vmm) {
    let sock = dir.join(format!("{name}.sock"));
    let srv = serve_from_store(s3, &sock, "s3://snaps/base", &dir.join("cache-src"));
    let mut fc = Vmm::start(&firecracker(), dir, name).unwrap();
    fc.load_tracked(vmstate, Backend::Uffd(&sock)).unwrap();
    fc.send(b'w').unwrap();
    let wrote = fc.line("WROTE", PASS).unwrap();
    assert_eq!(wrote, format!("WROTE {}", DIRTY_MB * 256));
    (srv, fc)
}

#[test]
fn a_running_firecracker_vm_moves_between_page_servers_and_reads_every_qword_right() {
    if let Some(why) = missing() {
        guestmem_testkit::skip(format_args!("{why}"));
        return;
    }
    // One Firecracker test at a time: two booting at once here had one's API refuse.
    let _one = guestmem_testkit::host_lock();
    let dir = Scratch::new("move");
    let s3 = S3Server::start("move", &["snaps"]);
    let vmstate = base_in_store(&dir, &s3);
    let (_src_srv, _src) = source_vm(&dir, &s3, &vmstate, "src");

    let mut dst = Vmm::start(&firecracker(), &dir, "dst").unwrap();
    let key = key_file(&dir, "move.key", 7);
    let (mut mi, addr) = move_in(&s3.env(), dst.api(), &dir, &key);
    let out = guestmem()
        .args(["move", "--api"])
        .arg(dir.join("src.api.sock"))
        .arg("--key-file")
        .arg(&key)
        .args(["--base", "s3://snaps/base", "--as", "moved", "--to", &addr])
        .args(["--listen", "127.0.0.1:0", "--work-dir"])
        .arg(dir.join("work"))
        .arg("--json")
        .envs(s3.env())
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{}\n{report}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("move: {report}");
    let r: serde_json::Value = serde_json::from_str(&report).unwrap();
    // The diff is what the guest wrote (and a few pages of its own state), and what went
    // over the wire is the diff, once.
    let diff = r["diff_bytes"].as_u64().unwrap();
    assert!(
        (DIRTY_MB << 20..(DIRTY_MB << 20) + (1 << 20)).contains(&diff),
        "{diff}"
    );
    let sent = r["bytes_sent"].as_u64().unwrap();
    assert!(sent <= diff + diff / 20, "sent {sent}, diff {diff}");
    assert!(r["risk_ms"].as_f64().unwrap() > 0.0);
    // The source is gone: the move ended it once the destination ran.
    assert!(!Path::new(&dir.join("work/moved.mem")).exists());

    // On the destination, every qword: the written pages and the base's.
    dst.send(b'g').unwrap();
    let pass = dst.line("PASS", PASS).unwrap();
    assert!(pass.ends_with(" BAD 0"), "{pass}");
    // SIGTERM to move-in drains it: the VM's memory brought in whole, and the VM runs on
    // without it, every qword still right.
    let pid = mi.child().id() as i32;
    // SAFETY: kill sends a signal to our own child's pid, which is alive (not yet reaped).
    let sent = unsafe { libc::kill(pid, libc::SIGTERM) };
    assert_eq!(sent, 0);
    let st = mi.wait_exit(60);
    let mut text = String::new();
    let _ = mi.child().stdout.take().unwrap().read_to_string(&mut text);
    eprintln!("move-in: {text}");
    assert!(st.success(), "{text}");
    assert!(text.contains("source released"), "{text}");
    dst.send(b't').unwrap();
    let touch = dst.line("TOUCH", PASS).unwrap();
    assert!(touch.ends_with(" BAD 0"), "{touch}");
    // The diff is in the store as a layer on the base.
    let ls = guestmem()
        .args(["snapshot", "ls", "s3://snaps"])
        .envs(s3.env())
        .output()
        .unwrap();
    let ls = String::from_utf8_lossy(&ls.stdout);
    assert!(ls.contains("moved"), "{ls}");
    // And every page as the host sees it: the VM's memory written out whole (a Full
    // snapshot, its pages now all brought in) against the base's. In the region only the
    // pages `w` wrote differ (what they hold, the guest's PASS checked); outside it, every
    // page is the base's but the low MiB (boot structures, the hypervisor's own pages) and
    // the guest program's image (its data and its stack), which the running guest and
    // the hypervisor write themselves.
    let after = dir.join("after.mem");
    dst.snapshot(&dir.join("after.vmstate"), &after).unwrap();
    let differ = vmm::pages_differing(&dir.join("base.mem"), &after).unwrap();
    let stray = vmm::stray_pages(&differ, REGION_MB, DIRTY_MB * 256);
    assert!(stray.is_none(), "{stray:?}");
    drop(dst);
}

#[test]
fn a_move_the_destination_refuses_leaves_the_vm_running_on_the_source() {
    if let Some(why) = missing() {
        guestmem_testkit::skip(format_args!("{why}"));
        return;
    }
    let _one = guestmem_testkit::host_lock();
    let dir = Scratch::new("move-refused");
    let s3 = S3Server::start("move-refused", &["snaps"]);
    let vmstate = base_in_store(&dir, &s3);
    let (_src_srv, mut src) = source_vm(&dir, &s3, &vmstate, "src");
    let dst = Vmm::start(&firecracker(), &dir, "dst").unwrap();
    let key = key_file(&dir, "move.key", 7);
    // The destination holds another move key: refused before the offer is read. The
    // destination drops that connection and waits on for a source that holds its key (a
    // connection that says the wrong thing cannot end a move-in).
    let other = key_file(&dir, "other.key", 8);
    let (mut mi, addr) = move_in(&s3.env(), dst.api(), &dir, &other);
    let (out, err) = move_out(&dir, &key, &addr, &s3.env());
    assert!(!out.status.success());
    assert!(err.contains("move's key"), "{err}");
    std::thread::sleep(std::time::Duration::from_millis(500));
    assert!(
        mi.running(),
        "move-in ended on a connection with the wrong key"
    );
    drop(mi);
    // The destination's credentials are wrong: it cannot read the base.
    let env: Vec<(&'static str, String)> = s3
        .env()
        .into_iter()
        .map(|(k, v)| match k {
            "AWS_SECRET_ACCESS_KEY" => (k, "not-the-secret".to_string()),
            _ => (k, v),
        })
        .collect();
    let (mut mi, addr) = move_in(&env, dst.api(), &dir, &key);
    let (out, err) = move_out(&dir, &key, &addr, &s3.env());
    assert!(!out.status.success());
    assert!(err.contains("destination refused the move"), "{err}");
    assert!(err.contains("s3://snaps/"), "names the URL: {err}");
    assert!(!err.contains("not-the-secret"), "{err}");
    assert!(!mi.wait_exit(20).success());
    // Never paused: the source VM answers, every qword right.
    src.send(b'g').unwrap();
    let pass = src.line("PASS", PASS).unwrap();
    assert!(pass.ends_with(" BAD 0"), "{pass}");
}
