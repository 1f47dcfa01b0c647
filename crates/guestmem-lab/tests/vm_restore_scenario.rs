//! The vm-restore scenario at a tiny size: every way restores a guest that verifies every
//! page (the scenario refuses a run with one wrong dword), and the plain readers read the
//! whole memory file.

mod common;

use guestmem_lab::run::{Order, Protocol};
use guestmem_lab::vm_restore::{run_vm_restore, VmRestoreLabConfig, WAYS};

#[test]
fn vm_restore_tiny_every_way_verifies_every_page() {
    if !common::kvm_usable() {
        return;
    }
    let _serial = guestmem_testkit::host_lock();
    let scratch = guestmem_testkit::Scratch::new("vm-restore-scenario");
    let cfg = VmRestoreLabConfig {
        size: 64 << 20,
        vcpus: 2,
        protocol: Protocol {
            warmup: 0,
            rounds: 1,
            order: Order::Rotate,
        },
        work_dir: scratch.join("work"),
        command: "test".into(),
    };
    let r = run_vm_restore(&cfg).expect("every way restores and verifies");
    assert_eq!(r.body.variants.len(), WAYS.len());
    for v in &r.body.variants {
        let s = &v.samples[0].sample;
        assert!(s.verify_done_secs > 0.0, "{}: {s:?}", v.way.name());
        assert!(
            s.setup_secs <= s.verify_done_secs,
            "{}: {s:?}",
            v.way.name()
        );
    }
    let by = |name: &str| {
        r.body
            .variants
            .iter()
            .find(|v| v.way.name() == name)
            .unwrap_or_else(|| panic!("{name}"))
            .samples[0]
            .sample
            .clone()
    };
    // The Firecracker-style peer serves a fault per 4 KiB page; guestmem's lazy restores a
    // block (1 MiB) per fault; eager restores need none.
    assert!(by("fc-peer").faults >= 64 * 256 / 2, "{:?}", by("fc-peer"));
    assert!(by("lazy-none-2h").faults < by("fc-peer").faults);
    assert_eq!(by("eager").faults, 0);
    assert!(!scratch.join("work").exists(), "the work folder is removed");
}
