//! The guest and the host see each other's writes through the same memslots.

#![cfg(feature = "kvm")]

mod common;

use guestmem::kvm::guest::{pattern, Partition, Workload, WorkloadConfig};
use guestmem::GuestAddress;

const VCPUS: usize = 4;
const SLOTS: usize = 64;
const BYTES: u64 = 128 << 20;

#[test]
fn guest_write_pass_every_slot_host_reads_pattern_back() {
    if !common::kvm_usable() {
        return;
    }
    let s = common::setup(BYTES, SLOTS);
    let config = WorkloadConfig {
        vcpus: VCPUS,
        partition: Partition::PerSlot,
    };
    let work = Workload::start(&s.vm, &s.map, &s.data, config).unwrap();

    let out = work.write_pass(7).unwrap();

    assert_eq!(out.values, vec![7; VCPUS]);
    let t = s.map.translator();
    let mut pages = 0;
    for v in 0..VCPUS {
        // Every vCPU has a slice in every slot.
        assert_eq!(work.slice(v).len(), SLOTS);
        for &(start, end) in work.slice(v) {
            for gpa in (start..end).step_by(4096) {
                let mut b = [0u8; 8];
                t.read(GuestAddress(gpa), &mut b).unwrap();
                assert_eq!(
                    u32::from_le_bytes(b[..4].try_into().unwrap()),
                    pattern(gpa, 7)
                );
                // Only the first dword of each page is written.
                assert_eq!(&b[4..], &[0; 4], "gpa {gpa:#x}");
                pages += 1;
            }
        }
    }
    assert_eq!(pages, BYTES / 4096);
}

#[test]
fn host_writes_guest_verifies_and_reports_a_corrupted_page() {
    if !common::kvm_usable() {
        return;
    }
    let s = common::setup(BYTES, SLOTS);
    let config = WorkloadConfig {
        vcpus: VCPUS,
        partition: Partition::PerSlot,
    };
    let work = Workload::start(&s.vm, &s.map, &s.data, config).unwrap();
    let t = s.map.translator();
    let tag = 0x5a5;
    for v in 0..VCPUS {
        for &(start, end) in work.slice(v) {
            for gpa in (start..end).step_by(4096) {
                let p = pattern(gpa, tag).to_le_bytes();
                t.write(GuestAddress(gpa), &p).unwrap();
                t.write(GuestAddress(gpa + 4092), &p).unwrap();
            }
        }
    }

    assert_eq!(work.verify(tag).unwrap().values, vec![0; VCPUS]);
    // A wrong tag fails both dwords of every page.
    let per_vcpu: Vec<u32> = (0..VCPUS)
        .map(|v| {
            work.slice(v)
                .iter()
                .map(|(a, b)| ((b - a) / 4096 * 2) as u32)
                .sum()
        })
        .collect();
    assert_eq!(work.verify(tag + 1).unwrap().values, per_vcpu);

    // One corrupted dword in vCPU 2's last slice.
    let (_, end) = *work.slice(2).last().unwrap();
    t.write(GuestAddress(end - 4), &[0xff; 4]).unwrap();
    assert_eq!(work.verify(tag).unwrap().values, vec![0, 0, 1, 0]);
}
