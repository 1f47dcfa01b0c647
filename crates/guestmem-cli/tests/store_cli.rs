//! Snapshots in object storage, through the `guestmem` binary, against a real S3 server the
//! test starts itself (the test kit's s3s-fs on 127.0.0.1): push, pull, ls and gc; serving a
//! VM straight from the store, from a cold and a warm cache; and what happens when the
//! store misbehaves.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::Duration;

use common::*;
use guestmem_testkit::s3::{S3Server, SECRET_KEY};

guestmem_testkit::standin_child_test!();

const BUCKET: &str = "snaps";

/// `guestmem ARGS` with the server's environment; its exit code, stdout, stderr.
fn gm(s3: &S3Server, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_guestmem"))
        .args(args)
        .envs(s3.env())
        .env_remove("AWS_PROFILE")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

fn ok(s3: &S3Server, args: &[&str]) -> String {
    let (code, out, err) = gm(s3, args);
    assert_eq!(code, 0, "guestmem {args:?}: {err}");
    assert!(!err.contains(SECRET_KEY) && !out.contains(SECRET_KEY));
    out
}

fn json(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or_else(|e| panic!("{e}: {s}"))
}

/// `guestmem serve-uffd` of `url` on `socket` with the server's environment and `extra`
/// flags, its socket listening.
fn serve(s3: &S3Server, socket: &Path, url: &str, extra: &[&str]) -> Srv {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
    cmd.args(["serve-uffd", "--socket"])
        .arg(socket)
        .args(["--mem-file", url])
        .args(extra)
        .envs(s3.env());
    let mut g = Srv::start(&mut cmd);
    let t = std::time::Instant::now();
    while !socket.exists() {
        if !g.running() {
            let (out, err) = g.output();
            panic!("the server exited before listening: {out} {err}");
        }
        assert!(t.elapsed() < Duration::from_secs(30), "no socket appeared");
        std::thread::sleep(Duration::from_millis(5));
    }
    g
}

/// [`serve`] with `--once`.
fn serve_once(s3: &S3Server, socket: &Path, url: &str, extra: &[&str]) -> Srv {
    let mut args = vec!["--once"];
    args.extend_from_slice(extra);
    serve(s3, socket, url, &args)
}

/// A raw memory file pushed (zero frames stored nowhere, compressed where it pays), listed,
/// pushed again under another name (nothing uploaded), and pulled back byte for byte; a
/// Firecracker-style Diff (a sparse file) pushed on it stores only its pages, and pulls as
/// the base with those pages laid over.
#[test]
fn push_ls_pull_and_a_diff_on_a_base() {
    let d = Scratch::new("store-push");
    let s3 = S3Server::start("push", &[BUCKET]);
    let mem = memory_file(&d, 8 * MIB, Some(3 * MIB));
    let url = format!("s3://{BUCKET}/vm/base");
    let r = json(&ok(
        &s3,
        &[
            "snapshot",
            "push",
            "--frame-size",
            "1M",
            mem.to_str().unwrap(),
            &url,
            "--json",
        ],
    ));
    assert_eq!(r["frames"], 8);
    assert_eq!(r["zero_frames"], 1, "{r}");
    assert_eq!(r["objects_stored"], 7, "{r}");
    // Pushed again under another name: every frame is there already.
    let r = json(&ok(
        &s3,
        &[
            "snapshot",
            "push",
            "--frame-size",
            "1M",
            mem.to_str().unwrap(),
            &format!("s3://{BUCKET}/vm/copy"),
            "--json",
        ],
    ));
    assert_eq!(r["objects_stored"], 0, "{r}");
    assert_eq!(r["objects_skipped"], 7, "{r}");
    // A name is never replaced.
    let (code, _, err) = gm(
        &s3,
        &[
            "snapshot",
            "push",
            "--frame-size",
            "1M",
            mem.to_str().unwrap(),
            &url,
        ],
    );
    assert_eq!(code, 1);
    assert!(err.contains("already"), "{err}");
    let ls = ok(&s3, &["snapshot", "ls", &format!("s3://{BUCKET}")]);
    assert!(
        ls.contains("s3://snaps/vm/base") && ls.contains("s3://snaps/vm/copy"),
        "{ls}"
    );

    let back = d.join("back");
    ok(&s3, &["snapshot", "pull", &url, back.to_str().unwrap()]);
    assert!(
        std::fs::read(&back).unwrap() == std::fs::read(&mem).unwrap(),
        "pulled bytes differ"
    );

    // A diff: 3 pages written in frame 1, a whole frame 5, one page in the base's hole.
    // Its holes are the base's pages, so its folder must report data page by page.
    if let Err(e) = guestmem::store::check_diff_folder(&d) {
        guestmem_testkit::skip(format_args!("the diff part: {e}"));
        return;
    }
    use std::os::unix::fs::FileExt;
    let diff = d.join("diff");
    let f = std::fs::File::create(&diff).unwrap();
    f.set_len(8 * MIB as u64).unwrap();
    let page = vec![0xabu8; PAGE];
    for at in [
        MIB + 4 * PAGE,
        MIB + 5 * PAGE,
        MIB + 100 * PAGE,
        3 * MIB + 7 * PAGE,
    ] {
        f.write_all_at(&page, at as u64).unwrap();
    }
    f.write_all_at(&vec![0xcd; MIB], 5 * MIB as u64).unwrap();
    let durl = format!("s3://{BUCKET}/vm/diff1");
    // Last written two hours after it was made: Firecracker merged this Diff into a file
    // that was there (it does not truncate one of the memory's size), so the pages the
    // file held before would go as changed. Refused, naming the file and the way out.
    let mut push_args = vec![
        "snapshot",
        "push",
        diff.to_str().unwrap(),
        &durl,
        "--base",
        &url,
        "--json",
    ];
    if f.metadata().unwrap().created().is_ok() {
        f.set_modified(std::time::SystemTime::now() + Duration::from_secs(7200))
            .unwrap();
        let (code, _, err) = gm(&s3, &push_args);
        assert_ne!(code, 0, "a reused Diff file was pushed");
        assert!(
            err.contains(diff.to_str().unwrap()) && err.contains("--reused-file"),
            "{err}"
        );
        let listed = ok(&s3, &["snapshot", "ls", &format!("s3://{BUCKET}")]);
        assert!(
            listed.contains("vm/") && !listed.contains("diff1"),
            "{listed}"
        );
        // Told it held only this VM's pages on this base, the push takes it.
        push_args.push("--reused-file");
    } else {
        eprintln!(
            "{} keeps no birth time: the reused-file check not tried",
            d.display()
        );
    }
    drop(f);
    let r = json(&ok(&s3, &push_args));
    assert_eq!(r["base_frames"], 5, "{r}");
    // Two pieces of pages (frames 1 and 3) and one whole frame (5, compressed).
    assert_eq!(r["objects_stored"], 3, "{r}");
    assert!(
        r["bytes_stored"].as_u64().unwrap() < (4 * PAGE + 64 * 1024) as u64,
        "{r}"
    );
    let dback = d.join("dback");
    ok(&s3, &["snapshot", "pull", &durl, dback.to_str().unwrap()]);
    let mut want = std::fs::read(&mem).unwrap();
    for at in [
        MIB + 4 * PAGE,
        MIB + 5 * PAGE,
        MIB + 100 * PAGE,
        3 * MIB + 7 * PAGE,
    ] {
        want[at..at + PAGE].fill(0xab);
    }
    want[5 * MIB..6 * MIB].fill(0xcd);
    assert!(
        std::fs::read(&dback).unwrap() == want,
        "the diff did not pull as base + pages"
    );
}

/// `guestmem snapshot gc s3://snaps --grace-s GRACE --json`, which must succeed: its report.
fn gc_json(s3: &S3Server, grace: &str) -> serde_json::Value {
    json(&ok(
        s3,
        &["snapshot", "gc", "s3://snaps", "--grace-s", grace, "--json"],
    ))
}

/// `guestmem snapshot push --frame-size 1M SRC TO`, which must succeed.
fn push_1m(s3: &S3Server, src: &Path, to: &str) -> String {
    ok(
        s3,
        &[
            "snapshot",
            "push",
            "--frame-size",
            "1M",
            src.to_str().unwrap(),
            to,
        ],
    )
}

/// gc deletes the frames no snapshot names (past the grace), and never one a snapshot
/// still names; with a push's lease in the bucket it deletes nothing.
#[test]
fn gc_deletes_only_what_no_snapshot_names() {
    let d = Scratch::new("store-gc");
    let s3 = S3Server::start("gc", &[BUCKET]);
    let a = memory_file(&d, 4 * MIB, None);
    let b = d.join("b");
    std::fs::write(&b, vec![7u8; 2 * MIB]).unwrap();
    push_1m(&s3, &a, "s3://snaps/a");
    push_1m(&s3, &b, "s3://snaps/b");
    // b is deleted (its manifest): its one frame is named by nobody.
    std::fs::remove_dir_all(s3.bucket_dir(BUCKET).join("snapshots/b")).unwrap();
    let r = gc_json(&s3, "3600");
    assert_eq!(r["deleted"], 0, "young frames are kept: {r}");
    // A FIFO is refused at once, not waited on for a writer.
    let fifo = d.join("fifo");
    let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
    // SAFETY: a NUL-terminated path, live for the call.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let (code, _, err) = gm(
        &s3,
        &["snapshot", "push", fifo.to_str().unwrap(), "s3://snaps/f"],
    );
    assert_eq!(code, 1);
    assert!(err.contains("a FIFO") && err.contains("fifo"), "{err}");
    // The longest grace keeps every frame (it wrapped to a negative age: none kept).
    let r = gc_json(&s3, &u64::MAX.to_string());
    assert_eq!(r["deleted"], 0, "the longest grace keeps all: {r}");
    // gc takes a whole bucket: a name would look like it narrowed it.
    let (code, _, err) = gm(&s3, &["snapshot", "gc", "s3://snaps/a", "--grace-s", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("takes a whole bucket (s3://snaps)"), "{err}");
    // A push in progress holds off gc.
    let lease = s3.bucket_dir(BUCKET).join("leases");
    std::fs::create_dir_all(&lease).unwrap();
    std::fs::write(lease.join("x.1.1"), b"{}").unwrap();
    let (code, _, err) = gm(&s3, &["snapshot", "gc", "s3://snaps", "--grace-s", "0"]);
    assert_eq!(code, 1);
    assert!(err.contains("a push is in progress"), "{err}");
    std::fs::remove_dir_all(&lease).unwrap();
    let r = gc_json(&s3, "0");
    assert_eq!(r["deleted"], 1, "{r}");
    assert_eq!(r["named"], 4, "{r}");
    let back = d.join("back");
    ok(
        &s3,
        &["snapshot", "pull", "s3://snaps/a", back.to_str().unwrap()],
    );
    assert!(std::fs::read(&back).unwrap() == std::fs::read(&a).unwrap());
    // A VM's memory, readable by its owner only.
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&back).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "{mode:o}");
}

/// The frames under `frames/` in the bucket's directory, by name.
fn frame_names(s3: &S3Server) -> std::collections::BTreeSet<String> {
    std::fs::read_dir(s3.bucket_dir(BUCKET).join("frames"))
        .map(|d| {
            d.map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Sets the modification time s3s-fs reports as `LastModified` of `path` to `ago` before now.
fn age(path: &Path, ago: Duration) {
    let f = std::fs::File::options().write(true).open(path).unwrap();
    f.set_modified(std::time::SystemTime::now() - ago).unwrap();
}

/// gc measures ages by the store's `LastModified`: of two frames no snapshot names, it
/// deletes the one older than the grace and keeps the younger; a push's lease the store
/// last saw renewed longer ago than a live push renews it holds nothing off, and a gc mark
/// left as long ago (a gc killed mid-run) holds off no push.
#[test]
fn gc_ages_frames_and_leases_by_the_stores_clock() {
    let d = Scratch::new("store-gc-ages");
    let s3 = S3Server::start("gc-ages", &[BUCKET]);
    let push = |src: &Path, to: &str| push_1m(&s3, src, to);
    let a = memory_file(&d, 4 * MIB, None);
    push(&a, "s3://snaps/a");
    let mut frames = frame_names(&s3);
    let mut unnamed = Vec::new();
    for (name, byte) in [("old", 7u8), ("young", 8u8)] {
        let f = d.join(name);
        std::fs::write(&f, vec![byte; MIB]).unwrap();
        push(&f, &format!("s3://snaps/{name}"));
        let now = frame_names(&s3);
        let new: Vec<String> = now.difference(&frames).cloned().collect();
        assert_eq!(new.len(), 1, "{name}: one new frame: {new:?}");
        unnamed.push(new[0].clone());
        frames = now;
        std::fs::remove_dir_all(s3.bucket_dir(BUCKET).join("snapshots").join(name)).unwrap();
    }
    let bucket = s3.bucket_dir(BUCKET);
    age(
        &bucket.join("frames").join(&unnamed[0]),
        Duration::from_secs(2 * 3600),
    );
    // A push's lease last renewed 20 minutes ago: its push died (live ones renew every
    // minute, and count as gone after 10).
    std::fs::create_dir_all(bucket.join("leases")).unwrap();
    let lease = bucket.join("leases").join("x.1.1");
    std::fs::write(&lease, b"{}").unwrap();
    age(&lease, Duration::from_secs(20 * 60));
    let r = gc_json(&s3, "3600");
    assert_eq!(r["deleted"], 1, "{r}");
    assert_eq!(r["young"], 1, "{r}");
    let left = frame_names(&s3);
    assert!(!left.contains(&unnamed[0]), "the old frame stayed");
    assert!(left.contains(&unnamed[1]), "the young frame went");
    // A gc mark as old (its gc was killed) does not hold off a push.
    std::fs::create_dir_all(bucket.join("leases").join("gc")).unwrap();
    let mark = bucket.join("leases").join("gc").join("dead");
    std::fs::write(&mark, b"{}").unwrap();
    age(&mark, Duration::from_secs(20 * 60));
    let t = std::time::Instant::now();
    push(&d.join("old"), "s3://snaps/again");
    assert!(
        t.elapsed() < Duration::from_secs(60),
        "a push waited on a dead gc's mark for {:?}",
        t.elapsed()
    );
    assert!(
        frame_names(&s3).contains(&unnamed[0]),
        "the frame came back"
    );
}

/// A VM served straight from the store, every word checked, frames kept in the cache; a
/// second server over the same cache serves the next VM with the store gone.
#[test]
fn a_vm_is_served_from_the_store_and_then_from_the_cache_alone() {
    need_uffd!();
    let d = Scratch::new("store-serve");
    let mut s3 = S3Server::start("serve", &[BUCKET]);
    let mem = memory_file(&d, 16 * MIB, Some(9 * MIB));
    push_1m(&s3, &mem, "s3://snaps/vm");
    let cache = d.join("cache");
    let socket = d.join("uffd.sock");
    let extra = ["--cache-dir", cache.to_str().unwrap(), "--json"];
    let srv = serve_once(&s3, &socket, "s3://snaps/vm", &extra);
    let mut vm = Standin::new(&[12 * MIB, 4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let rep = json(&out);
    assert_eq!(
        rep["status"]["store"]["gets"], 15,
        "one GET a data frame: {out}"
    );
    // Read-ahead landed frames before their faults: those faults took them from memory
    // (staged) or from the cache (hits).
    let s = &rep["status"]["store"];
    let n = |k: &str| s[k].as_u64().unwrap();
    assert!(
        n("cache_misses") + n("cache_hits") + n("staged") >= 15,
        "{out}"
    );
    // Read-ahead's limit on GETs in flight, between its floor and its ceiling.
    assert!((4..=64).contains(&n("ahead_limit")), "{out}");

    // The manifest is read at start; then the store stops answering.
    let control = d.join("control.sock");
    let mut with_control = extra.to_vec();
    with_control.extend(["--control", control.to_str().unwrap()]);
    let srv = serve_once(&s3, &socket, "s3://snaps/vm", &with_control);
    s3.stop();
    let mut vm = Standin::new(&[12 * MIB, 4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    vm.read_all(2);
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    // The store's counters, as Prometheus reads them (no credential among them).
    let metrics = ctl(&control, "metrics");
    assert!(
        metrics.contains("guestmem_cache_hits_total 15"),
        "{metrics}"
    );
    assert!(metrics.contains("guestmem_store_gets_total 0"), "{metrics}");
    assert!(metrics.contains("guestmem_store_ahead_limit "), "{metrics}");
    assert!(
        metrics.contains("guestmem_store_fetch_latency_seconds"),
        "{metrics}"
    );
    assert!(!metrics.contains(SECRET_KEY) && !metrics.contains("GMTESTACCESSKEY"));
    vm.disconnect();
    let (code, out, err) = finish(srv);
    assert_eq!(code, 0, "{err}");
    let rep = json(&out);
    assert_eq!(rep["status"]["store"]["gets"], 0, "{out}");
    assert_eq!(rep["status"]["store"]["cache_hits"], 15, "{out}");
}

/// What is refused before any VM is served, each naming the URL: no such snapshot, no
/// such bucket, wrong credentials (never printed).
#[test]
fn a_snapshot_that_cannot_be_read_is_refused_before_any_vm() {
    let d = Scratch::new("store-refuse");
    let s3 = S3Server::start("refuse", &[BUCKET]);
    let socket = d.join("uffd.sock");
    for (url, wrong_key, says) in [
        (
            "s3://snaps/none",
            false,
            "s3://snaps/none: no such snapshot",
        ),
        ("s3://nobucket/x", false, "s3://nobucket/"),
        ("s3://snaps/x", true, "s3://snaps/"),
    ] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_guestmem"));
        cmd.args(["serve-uffd", "--once", "--socket"])
            .arg(&socket)
            .args(["--mem-file", url])
            .envs(s3.env());
        if wrong_key {
            cmd.env("AWS_SECRET_ACCESS_KEY", "wrong-secret-key-123");
        }
        let out = cmd.output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{url}: {err}");
        assert!(err.contains(says), "{url}: {err}");
        assert!(
            !err.contains("wrong-secret-key-123") && !err.contains(SECRET_KEY),
            "{err}"
        );
        assert!(!socket.exists(), "no socket for a refused server");
    }
}

/// A store that stops answering mid-serve: the fault waits, retried, until the deadline;
/// then the VM is ended through its pidfd and the reason logged. A frame whose bytes are
/// wrong (fetched twice) ends it the same way. Never a zero page.
#[test]
fn a_store_that_fails_mid_serve_ends_the_vm_with_the_reason() {
    need_uffd!();
    let d = Scratch::new("store-fail");
    let go = d.join("go");
    let socket = d.join("uffd.sock");
    let mem = memory_file(&d, 4 * MIB, None);
    for corrupt in [false, true] {
        let mut s3 = S3Server::start(if corrupt { "fail-hash" } else { "fail-gone" }, &[BUCKET]);
        push_1m(&s3, &mem, "s3://snaps/vm");
        if corrupt {
            // Every frame object's last byte flipped.
            for f in std::fs::read_dir(s3.bucket_dir(BUCKET).join("frames"))
                .unwrap()
                .flatten()
            {
                let mut b = std::fs::read(f.path()).unwrap();
                let n = b.len() - 1;
                b[n] ^= 0x55;
                std::fs::write(f.path(), b).unwrap();
            }
        }
        let srv = serve_once(
            &s3,
            &socket,
            "s3://snaps/vm",
            &["--fetch-deadline", "2", "--prefetch-threads", "0"],
        );
        let mut vm = vm_child(&socket, 4 * MIB, 0, ChildDoes::Handshake, &go);
        std::thread::sleep(Duration::from_millis(300));
        if !corrupt {
            s3.stop();
        }
        std::fs::write(&go, b"").unwrap();
        let (code, _, err) = finish(srv);
        assert_eq!(code, 1, "{err}");
        let why = if corrupt {
            "fetched twice"
        } else {
            "within the deadline"
        };
        assert!(err.contains(why), "{err}");
        assert!(err.contains("killed the peer"), "{err}");
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(vm.wait_exit(10).signal(), Some(libc::SIGKILL));
        let _ = std::fs::remove_file(&go);
    }
}

/// Eight VMs of one snapshot at once, in their own processes, through one server: every
/// frame is fetched once (the others wait on its GET or read it from the cache), and every
/// VM reads every word right.
#[test]
fn many_vms_of_one_snapshot_fetch_each_frame_once() {
    need_uffd!();
    let d = Scratch::new("store-fleet");
    let s3 = S3Server::start("fleet", &[BUCKET]);
    let mem = memory_file(&d, 8 * MIB, None);
    push_1m(&s3, &mem, "s3://snaps/vm");
    let socket = d.join("uffd.sock");
    let go = d.join("go");
    let cache = d.join("cache");
    let control = d.join("ctl.sock");
    let srv = serve(
        &s3,
        &socket,
        "s3://snaps/vm",
        &[
            "--cache-dir",
            cache.to_str().unwrap(),
            "--json",
            "--prefetch-threads",
            "0",
            "--control",
            control.to_str().unwrap(),
        ],
    );
    wait_for(&control);
    let mut vms: Vec<Guard> = (0..8)
        .map(|_| vm_child(&socket, 8 * MIB, 0, ChildDoes::Handshake, &go))
        .collect();
    // All eight taken before any reads (exec'd test binaries, slow to start on a busy
    // host): then they read at once.
    let t = std::time::Instant::now();
    while !ctl(&control, "health").contains("\"vms\":8") {
        assert!(t.elapsed() < Duration::from_secs(30), "not every VM came");
        std::thread::sleep(Duration::from_millis(10));
    }
    std::fs::write(&go, b"").unwrap();
    // Each child reads every page, checks it against the file's pattern, and waits: with
    // no prefetch, a VM's memory is all in once it has read its last page.
    let all_in = || {
        let st: serde_json::Value = serde_json::from_str(&ctl(&control, "status")).unwrap();
        st["sessions"]
            .as_array()
            .unwrap()
            .iter()
            .all(|s| s["engine"]["complete_secs"].is_number())
    };
    while !all_in() {
        assert!(
            t.elapsed() < Duration::from_secs(60),
            "a VM did not read all its memory"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    for vm in &mut vms {
        assert!(vm.running(), "a VM failed its reads or was ended");
    }
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    let rep = json(&out);
    let s = &rep["status"]["store"];
    assert_eq!(s["gets"], 8, "one GET a data frame for 8 VMs: {s}");
    assert_eq!(rep["status"]["sockets"][0]["sessions"], 8, "{out}");
}

/// A server serving from the store is killed (`kill -9`) half-way through a VM: the next
/// server on the same state and cache directories takes the VM back, finds in the cache
/// every frame the first one fetched (fetching only the rest), and the VM reads every word
/// right.
#[test]
fn a_kill_9_mid_serve_from_the_store_loses_nothing_and_the_cache_is_reused() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = Scratch::new("store-kill9");
    let s3 = S3Server::start("kill9", &[BUCKET]);
    let mem = memory_file(&d, SIZE, None);
    push_1m(&s3, &mem, "s3://snaps/vm");
    let socket = d.join("uffd.sock");
    let (state, cache) = (d.join("state"), d.join("cache"));
    let args = [
        "--threads",
        "2",
        "--prefetch-threads",
        "0",
        "--json",
        "--state-dir",
        state.to_str().unwrap(),
        "--cache-dir",
        cache.to_str().unwrap(),
    ];
    let start = || serve(&s3, &socket, "s3://snaps/vm", &args);
    let mut first = start();
    let mut vm = Standin::new(&[SIZE], false).unwrap();
    vm.connect(&socket).unwrap();
    let t = std::time::Instant::now();
    while std::fs::read_dir(&state).map_or(0, |d| d.count()) == 0 {
        assert!(t.elapsed() < Duration::from_secs(10), "no session record");
        std::thread::sleep(Duration::from_millis(5));
    }
    // The first half read (8 frames fetched), then, once they are kept (a frame is written
    // to the cache after its readers have it), the server dies.
    for p in 0..SIZE / 2 / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64));
    }
    let kept = || {
        let segs = std::fs::read_dir(cache.join("segments"))
            .into_iter()
            .flatten();
        segs.flatten()
            .map(|f| whole_records(&f.path()))
            .sum::<usize>()
    };
    let t = std::time::Instant::now();
    while kept() < 8 {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{} frames kept",
            kept()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    // SAFETY: kill on our own child's pid.
    assert_eq!(unsafe { libc::kill(first.id() as i32, libc::SIGKILL) }, 0);
    first.wait_exit(5);
    let second = start();
    for p in 0..SIZE / PAGE {
        assert_eq!(vm.word(p * PAGE), word((p * PAGE) as u64), "page {p}");
    }
    let (code, out, err, _) = terminate(second);
    assert_eq!(code, 0, "{err}");
    assert!(err.contains("took back peer"), "{err}");
    let rep = json(&out);
    let s = &rep["status"]["store"];
    // The second server fetched only the frames the first never did.
    assert_eq!(s["gets"], 8, "{s}");
}

/// The records of a cache segment whose headers are written (a record's bytes go first, so
/// a restart finds these): each a 64-byte header (`GMCSEG01`, the frame's length, ...), the
/// frame, the next at a multiple of 64.
fn whole_records(seg: &Path) -> usize {
    let Ok(bytes) = std::fs::read(seg) else {
        return 0;
    };
    let (mut off, mut n) = (0usize, 0);
    while off + 64 <= bytes.len() && bytes[off..off + 8] == *b"GMCSEG01" {
        let len = u64::from_le_bytes(bytes[off + 8..off + 16].try_into().unwrap()) as usize;
        off = (off + 64 + len).next_multiple_of(64);
        n += 1;
    }
    n
}

/// A push interrupted (SIGINT) ends once the frames under way are up: nothing published,
/// its lease given back, so a gc after it is not held off; the signal is said on stderr.
#[test]
fn an_interrupted_push_publishes_nothing_and_gives_back_its_lease() {
    use std::process::Stdio;
    let d = Scratch::new("store-push-int");
    let s3 = S3Server::start("push-int", &[BUCKET]);
    let mem = memory_file(&d, 16 * MIB, None);
    // A HEAD a frame, 100 ms each, one thread: the push takes over a second and a half.
    s3.delay_heads(Duration::from_millis(100));
    let mut g = guestmem_testkit::ChildGuard::new(
        Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .args(["snapshot", "push", "--threads", "1", "--frame-size", "1M"])
            .arg(&mem)
            .arg("s3://snaps/int")
            .envs(s3.env())
            .env_remove("AWS_PROFILE")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let leases = s3.bucket_dir(BUCKET).join("leases");
    let held = |p: &Path| std::fs::read_dir(p).map(|r| r.count()).unwrap_or(0);
    let t0 = std::time::Instant::now();
    while held(&leases) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(30), "no lease taken");
        assert!(g.running(), "the push ended before its lease was seen");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill takes a pid and a signal; the child is ours and not reaped.
    assert_eq!(unsafe { libc::kill(g.id() as i32, libc::SIGINT) }, 0);
    let t0 = std::time::Instant::now();
    let status = loop {
        if let Some(s) = g.child().try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "the push did not end"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(g.child().stderr.as_mut().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("signal 2: stopping") && err.contains("asked to stop"),
        "{err}"
    );
    assert_eq!(held(&leases), 0, "its lease was left");
    let listed = ok(&s3, &["snapshot", "ls", &format!("s3://{BUCKET}")]);
    assert!(!listed.contains("int"), "{listed}");
}
