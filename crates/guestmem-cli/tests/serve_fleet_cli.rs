//! `guestmem serve-uffd` serving every VM, as an operator runs it: SIGTERM drains it (every
//! VM graduates, exit 0), one pool of threads for all VMs, systemd's readiness, JSON logs,
//! the control socket and metrics, huge pages regained, and a memory bounded by the VMs it
//! serves now, not by how many it has served.

mod common;

use std::time::{Duration, Instant};

use common::*;

/// SIGTERM drains the server: every VM graduates (its memory all in, unregistered), the
/// sockets are removed, it exits 0; one pool of threads served them all.
#[test]
fn sigterm_drains_and_every_vm_graduates_on_one_pool() {
    need_uffd!();
    const VMS: usize = 8;
    const SIZE: usize = 8 * MIB;
    let d = dir("drain");
    let mem = memory_file(&d, SIZE, None);
    let socket = d.join("uffd.sock");
    // The stand-ins are threads of this process: a failure is left (the test then fails on
    // what the VM reads).
    let srv = server(
        &[(&socket, &mem)],
        &["--threads", "2", "--on-failure", "leave"],
    );
    let mut vms: Vec<Standin> = (0..VMS)
        .map(|_| Standin::new(&[SIZE], false).unwrap())
        .collect();
    for vm in &mut vms {
        vm.connect(&socket).unwrap();
        assert_eq!(vm.word(0), word(0));
    }
    let threads = status_field(srv.id(), "Threads:");
    assert!(
        threads < VMS as u64,
        "{threads} threads serve {VMS} VMs: the pool should be shared"
    );
    let (code, out, err, took) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(took < Duration::from_secs(10), "drained in {took:?}");
    assert!(
        out.contains(&format!("{VMS} VMs: {VMS} graduated")),
        "{out}\n{err}"
    );
    assert!(!socket.exists(), "socket removed");
    for vm in &vms {
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    }
}

#[test]
fn a_server_tells_systemd_it_is_ready_once_it_listens() {
    need_uffd!();
    let d = dir("notify");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let notify = d.join("notify.sock");
    let rx = std::os::unix::net::UnixDatagram::bind(&notify).unwrap();
    rx.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let srv = Srv::start(
        std::process::Command::new(env!("CARGO_BIN_EXE_guestmem"))
            .args(["serve-uffd", "--socket"])
            .arg(&socket)
            .arg("--mem-file")
            .arg(&mem)
            .env("NOTIFY_SOCKET", &notify),
    );
    let mut buf = [0u8; 256];
    let n = rx.recv(&mut buf).expect("a notification within 20 s");
    let msg = std::str::from_utf8(&buf[..n]).unwrap();
    assert!(msg.starts_with("READY=1\n"), "{msg:?}");
    assert!(socket.exists(), "ready only once the socket listens");
    let (code, _, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
}

#[test]
fn json_logs_carry_one_structured_event_per_session_start_and_end() {
    need_uffd!();
    let d = dir("json");
    let mem = memory_file(&d, 4 * MIB, None);
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let srv = server(
        &[(&socket, &mem)],
        &[
            "--log-format",
            "json",
            "--on-failure",
            "leave",
            "--control",
            control.to_str().unwrap(),
        ],
    );
    wait_for(&control);
    let mut vm = Standin::new(&[4 * MIB], false).unwrap();
    vm.connect(&socket).unwrap();
    assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    vm.disconnect();
    // The hang-up seen before the stop: a drain that came first would end the session as
    // graduated.
    wait_no_vms(&control);
    let (code, _, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    let events: Vec<serde_json::Value> = err
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    let of = |kind: &str| {
        events
            .iter()
            .filter(|e| e["fields"]["event"] == kind)
            .collect::<Vec<_>>()
    };
    let start = of("start");
    assert_eq!(start.len(), 1, "{err}");
    assert_eq!(start[0]["fields"]["session"], 0);
    assert_eq!(start[0]["fields"]["bytes"], 4 * MIB as u64);
    assert_eq!(
        start[0]["fields"]["pid"].as_i64(),
        Some(std::process::id() as i64)
    );
    let end = of("end");
    assert_eq!(end.len(), 1, "{err}");
    assert_eq!(end[0]["fields"]["reason"], "peer-closed", "{err}");
}

#[test]
fn status_metrics_and_drain_over_the_control_socket() {
    need_uffd!();
    let d = dir("ctl");
    let mem = memory_file(&d, 8 * MIB, Some(3 * MIB));
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let mut srv = server(
        &[(&socket, &mem)],
        &[
            "--control",
            control.to_str().unwrap(),
            "--metrics",
            &addr,
            "--on-failure",
            "leave",
            // Faults alone: the counts below are the VM's.
            "--prefetch-threads",
            "0",
        ],
    );
    wait_for(&control);
    // Only this user may command the server (a hand-off gives away every VM's memory).
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&control).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "control socket mode {mode:o}");
    let mut vms: Vec<Standin> = (0..2)
        .map(|_| Standin::new(&[8 * MIB], false).unwrap())
        .collect();
    for vm in &mut vms {
        vm.connect(&socket).unwrap();
        vm.read_all(2);
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()));
    }
    let health = ctl(&control, "health");
    assert!(
        health.contains("\"ok\":true") && health.contains("\"vms\":2"),
        "{health}"
    );
    let status: serde_json::Value = serde_json::from_str(&ctl(&control, "status")).unwrap();
    let sessions = status["sessions"].as_array().unwrap();
    assert_eq!(sessions.len(), 2, "{status}");
    for s in sessions {
        // 8 blocks of 1 MiB, one of them a hole: every block came in for a fault.
        assert_eq!(s["engine"]["fault_blocks"], 8, "{s}");
        assert!(s["engine"]["first_fault_secs"].as_f64().is_some(), "{s}");
    }
    let lat = &status["sockets"][0]["fault_latency"];
    assert_eq!(lat["file"]["count"], 14, "{status}");
    assert_eq!(lat["zero"]["count"], 2, "{status}");
    let metrics = http_get(port, "/metrics");
    assert!(metrics.starts_with("HTTP/1.0 200 OK"), "{metrics}");
    assert!(metrics.contains("guestmem_fleet_vms 2"), "{metrics}");
    assert!(
        metrics.contains("guestmem_fault_latency_seconds_count{socket=\"0\",class=\"file\"} 14"),
        "{metrics}"
    );
    assert!(http_get(port, "/health").ends_with("ok\n"));
    assert!(http_get(port, "/nothing").starts_with("HTTP/1.0 404"));
    // One VM goes: its end is counted, by how.
    vms.pop();
    let t = Instant::now();
    loop {
        let metrics = http_get(port, "/metrics");
        if metrics.contains("guestmem_vms_ended_total{socket=\"0\",end=\"peer-closed\"} 1") {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(10), "{metrics}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(ctl(&control, "drain").contains("\"draining\":true"));
    let status = srv.wait_exit(10);
    assert_eq!(status.code(), Some(0));
    assert!(!control.exists(), "the control socket is removed");
}

/// Once a VM's memory is all in, the server collapses it to huge pages in the VM's process
/// (process_madvise through its pidfd); `--regain-huge-pages off` leaves it on 4 KiB pages.
/// A VM that goes mid-collapse stops its collapse after the chunk it is on, and the server
/// waits for that before it exits, so the collapse's end is always logged.
#[test]
fn a_served_vm_gets_huge_pages_back_and_a_collapse_ends_before_its_server() {
    need_uffd!();
    const SIZE: usize = 16 * MIB;
    let d = dir("regain");
    let mem = memory_file(&d, SIZE, None);
    for (switch, want_huge) in [("on", true), ("off", false)] {
        let socket = d.join(format!("uffd-{switch}.sock"));
        let srv = server(
            &[(&socket, &mem)],
            // Faults alone: all memory is in only once the last page is read.
            &[
                "--on-failure",
                "leave",
                "--regain-huge-pages",
                switch,
                "--prefetch-threads",
                "0",
            ],
        );
        let mut vm = Standin::new(&[SIZE], false).unwrap();
        vm.connect(&socket).unwrap();
        // Every page but the last: not all in yet, so no collapse has started (it starts
        // REGAIN_SETTLE after the last block comes in, which a held-up test may pass).
        for p in 0..SIZE / PAGE - 1 {
            vm.word(p * PAGE);
        }
        assert_eq!(vm.anon_huge().unwrap(), 0, "UFFDIO_COPY fills 4 KiB pages");
        vm.read_all(2);
        // The collapse runs a second after the last block is in: wait for it to start (at
        // least one chunk), then the VM goes, mid-collapse or after it.
        let t = Instant::now();
        while want_huge && vm.anon_huge().unwrap() < 2 * MIB as u64 {
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "no huge pages came back"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(vm.compare(&mem).unwrap(), Ok(()), "{switch}");
        vm.disconnect();
        let (code, _, err, _) = terminate(srv);
        assert_eq!(code, 0, "{err}");
        if want_huge {
            assert!(err.contains("huge pages regained in process"), "{err}");
        } else {
            assert_eq!(vm.anon_huge().unwrap(), 0, "off: left on 4 KiB pages");
        }
    }
}

/// A server's memory is bounded by the VMs it serves now: having served 2,000 VMs one
/// after another (a few at a time), it holds no more than after its first 100 (within
/// 1 MiB). It keeps totals, not a record of every VM.
#[test]
fn a_server_that_served_2000_vms_holds_what_it_held_after_100() {
    need_uffd!();
    const AT_ONCE: usize = 8;
    let d = dir("bounded");
    let mem = memory_file(&d, 2 * MIB, None);
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    // The stand-ins are threads of this one process, so a new one may be mapped where an
    // ended one was; a prefetch step of an ended session still copying there (through its
    // own userfaultfd, which the kernel lets fill any registered range of the address space)
    // would fill the new one's page. Faults alone: every copy is done before its fault
    // returns. Separate VM processes, as real ones are, never share an address space.
    let srv = server(
        &[(&socket, &mem)],
        &[
            "--threads",
            "2",
            "--prefetch-threads",
            "0",
            "--on-failure",
            "leave",
            "--regain-huge-pages",
            "off",
            "--control",
            control.to_str().unwrap(),
        ],
    );
    wait_for(&control);
    let serve = |n: usize| {
        for _ in 0..n / AT_ONCE {
            let mut vms: Vec<Standin> = (0..AT_ONCE)
                .map(|_| Standin::new(&[2 * MIB], false).unwrap())
                .collect();
            for vm in &mut vms {
                vm.connect(&socket).unwrap();
            }
            for vm in &mut vms {
                assert_eq!(vm.word(2 * MIB - 8), word((2 * MIB - 8) as u64));
                vm.disconnect();
            }
            // Unmapped only once the server has ended their sessions (see above).
            wait_no_vms(&control);
        }
    };
    let rss = || status_field(srv.id(), "VmRSS:");
    serve(104);
    let after_100 = rss();
    serve(1_896);
    let after_2000 = rss();
    eprintln!("server RSS: {after_100} kB after 104 VMs, {after_2000} kB after 2,000");
    let (code, out, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("2000 VMs"), "{out}");
    assert!(
        after_2000 <= after_100 + 1024,
        "grew from {after_100} kB to {after_2000} kB over 1,896 VMs"
    );
}

/// A server that served a VM of large blocks (16 MiB; a block with a page the balloon took is
/// staged whole by the thread that fills it) lets go of those threads' buffers once idle: its
/// anonymous memory comes back to what it was before the VM.
#[test]
fn a_server_lets_go_of_a_large_blocks_buffers_once_idle() {
    need_uffd!();
    const SIZE: usize = 64 * MIB;
    let d = dir("large-blocks");
    let mem = memory_file(&d, SIZE, None);
    let socket = d.join("uffd.sock");
    let control = d.join("ctl.sock");
    let srv = server(
        &[(&socket, &mem)],
        &[
            "--threads",
            "2",
            "--prefetch-threads",
            "0",
            "--block",
            "16M",
            "--on-failure",
            "leave",
            "--regain-huge-pages",
            "off",
            "--control",
            control.to_str().unwrap(),
        ],
    );
    wait_for(&control);
    let anon = || status_field(srv.id(), "RssAnon:");
    let before = anon();
    let mut vm = Standin::new(&[SIZE], true).unwrap();
    vm.connect(&socket).unwrap();
    for b in 0..SIZE / (16 * MIB) {
        // The balloon takes the block's first page before the VM touches the block.
        let start = b * 16 * MIB;
        vm.remove(start, 4096).unwrap();
        let at = start + 8 * 4096 + 8;
        assert_eq!(vm.word(at), word(at as u64));
        assert_eq!(vm.word(start), 0, "a page the balloon took reads zero");
    }
    let served = anon();
    vm.disconnect();
    wait_no_vms(&control);
    drop(vm);
    // Let go of after a second idle; a busy test host may take longer to run the thread.
    let t = Instant::now();
    let mut now = anon();
    while now > before + 8 * 1024 && t.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(100));
        now = anon();
    }
    eprintln!("server RssAnon: {before} kB before the VM, {served} kB serving it, {now} kB idle");
    let (code, _, err, _) = terminate(srv);
    assert_eq!(code, 0, "{err}");
    assert!(
        now <= before + 8 * 1024,
        "{now} kB of anonymous memory idle, {before} kB before the VM: buffers kept"
    );
}
