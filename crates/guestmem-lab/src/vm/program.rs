//! The guest program and the CPU state it runs in.
//!
//! # What this KVM accepts
//!
//! Measured on this machine's nested, paging-based KVM (Linux 6.18, Intel host):
//!
//! - **Flat 32-bit protected mode, paging off** ([`GuestMode::Protected32`], the default):
//!   CR0 = PE | ET, every segment cached as base 0, limit 4 GiB through `KVM_SET_SREGS` (no
//!   GDT in guest memory: no segment is ever reloaded), EFER = 0. Guest-physical equals
//!   linear; ranges must end at or below [`PROTECTED32_END`].
//! - **64-bit long mode** ([`GuestMode::Long64`]): runs, provided the guest has page tables.
//!   An earlier quick try that ended in a shutdown exit is explained by their absence: with
//!   CR0.PG set, the first fetch walks CR3. Here the loader writes identity-mapping tables
//!   (2 MiB pages, [`LONG64_END`] of guest-physical space) into the control region; CS is
//!   cached with L = 1, EFER = LME | LMA, CR4 = PAE, CR0 = PE | ET | PG. KVM accepted it with
//!   or without `KVM_SET_CPUID2`; guestmem sets no CPUID.
//!
//! # The program
//!
//! Both routines read a parameter block at `RSI`/`ESI`: a `u64` entry count, then that many
//! `{u64 start, u64 end}` page-aligned guest ranges (the vCPU's slice of each slot; 32-bit
//! code reads the low halves, all below 4 GiB). `EBX` holds a tag, and [`pattern`] is the
//! value stored: `gpa + tag`, wrapping, 32 bits.
//!
//! The write routine stores the pattern in the first dword of every page of every range,
//! then reports on port [`PORT_PASS_DONE`] with `out 0x10, eax` (a `KVM_EXIT_IO`); resumed,
//! it starts another pass with `tag + 1`. The verify routine counts, in `EBP`, the dwords at
//! page offsets 0 and 4092 that differ from the pattern, reports the count on
//! [`PORT_VERIFY_DONE`] and halts. Each routine was assembled with GNU `as` (Intel syntax);
//! the listings below give every byte. The verify routine sits 0x40 bytes after the write
//! routine, and the jump targets in its listing count from the write routine's start.

use guestmem::GuestAddress;
use kvm_bindings::kvm_segment;
use kvm_ioctls::VcpuFd;

use super::VmError;
use guestmem::GuestMap;

/// Guest address of the write routine; the verify routine is [`VERIFY_OFFSET`] further.
pub const CODE_GPA: u64 = 0x1000;
/// Offset of the verify routine from the write routine.
pub const VERIFY_OFFSET: u64 = 0x40;
/// Guest address of the long-mode page tables: PML4, PDPT, then the page directories.
pub const PAGE_TABLES_GPA: u64 = 0x10_0000;
/// Highest end (exclusive) of a range a 32-bit guest can walk.
pub const PROTECTED32_END: u64 = 0xffff_f000;
/// Guest-physical bytes the long-mode tables identity-map (one page directory per GiB).
pub const LONG64_END: u64 = 64 << 30;
/// Bytes the long-mode tables take at [`PAGE_TABLES_GPA`].
pub const PAGE_TABLES_BYTES: u64 = (2 + (LONG64_END >> 30)) * 4096;
/// The port the write routine reports a finished pass on.
pub const PORT_PASS_DONE: u16 = 0x10;
/// The port the verify routine reports its mismatch count on.
pub const PORT_VERIFY_DONE: u16 = 0x11;

/// The CPU mode the guest runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum GuestMode {
    /// Flat 32-bit protected mode, no paging: memory below 4 GiB.
    #[default]
    Protected32,
    /// 64-bit long mode on identity-mapped 2 MiB pages: memory below [`LONG64_END`].
    Long64,
}

impl GuestMode {
    /// The highest end (exclusive) of a range the guest can walk.
    pub fn end_limit(self) -> u64 {
        match self {
            GuestMode::Protected32 => PROTECTED32_END,
            GuestMode::Long64 => LONG64_END,
        }
    }

    fn routines(self) -> (&'static [u8], &'static [u8]) {
        match self {
            GuestMode::Protected32 => (&WRITE_32, &VERIFY_32),
            GuestMode::Long64 => (&WRITE_64, &VERIFY_64),
        }
    }
}

/// The dword the guest writes at the start of page `gpa` for `tag` (and expects at offsets
/// 0 and 4092 when verifying).
pub fn pattern(gpa: u64, tag: u32) -> u32 {
    (gpa as u32).wrapping_add(tag)
}

/// Writes the routines (and for long mode the page tables) into `map`'s control region.
pub(crate) fn load(map: &GuestMap, mode: GuestMode) -> Result<(), VmError> {
    let t = map.translator();
    let (write, verify) = mode.routines();
    t.write_in_region(GuestAddress(CODE_GPA), write)?;
    t.write_in_region(GuestAddress(CODE_GPA + VERIFY_OFFSET), verify)?;
    if mode == GuestMode::Long64 {
        t.write_in_region(GuestAddress(PAGE_TABLES_GPA), &identity_tables())?;
    }
    Ok(())
}

/// PML4 -> one PDPT -> `LONG64_END / 1 GiB` page directories of 2 MiB pages, identity
/// mapped, laid out from [`PAGE_TABLES_GPA`].
fn identity_tables() -> Vec<u8> {
    const PRESENT_WRITABLE: u64 = 0x3;
    const HUGE: u64 = 0x80;
    let pdpt = PAGE_TABLES_GPA + 0x1000;
    let mut entries = vec![0u64; (PAGE_TABLES_BYTES / 8) as usize];
    entries[0] = pdpt | PRESENT_WRITABLE;
    for g in 0..(LONG64_END >> 30) {
        let pd = PAGE_TABLES_GPA + 0x2000 + g * 0x1000;
        entries[512 + g as usize] = pd | PRESENT_WRITABLE;
        for i in 0..512u64 {
            let at = (pd - PAGE_TABLES_GPA) / 8 + i;
            entries[at as usize] = ((g << 30) + (i << 21)) | PRESENT_WRITABLE | HUGE;
        }
    }
    entries.iter().flat_map(|e| e.to_le_bytes()).collect()
}

/// Puts a fresh vCPU into `mode`: flat segments, and for long mode paging on.
pub(crate) fn setup_vcpu(vcpu: &VcpuFd, mode: GuestMode) -> Result<(), VmError> {
    let mut sregs = vcpu
        .get_sregs()
        .map_err(|e| VmError::ioctl("KVM_GET_SREGS", e))?;
    let long = mode == GuestMode::Long64;
    let code = kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: 0x08,
        type_: 0xb, // execute/read, accessed
        present: 1,
        dpl: 0,
        db: u8::from(!long), // 32-bit default operand size; must be 0 when L = 1
        s: 1,
        l: u8::from(long),
        g: 1,
        avl: 0,
        unusable: 0,
        padding: 0,
    };
    let data = kvm_segment {
        selector: 0x10,
        type_: 0x3, // read/write, accessed
        db: 1,
        l: 0,
        ..code
    };
    sregs.cs = code;
    (sregs.ds, sregs.es, sregs.fs, sregs.gs, sregs.ss) = (data, data, data, data, data);
    const CR0_PE: u64 = 1;
    const CR0_ET: u64 = 1 << 4;
    const CR0_PG: u64 = 1 << 31;
    const CR4_PAE: u64 = 1 << 5;
    const EFER_LME_LMA: u64 = (1 << 8) | (1 << 10);
    // Caches on (the reset value has CD and NW set).
    (sregs.cr0, sregs.cr4, sregs.efer) = if long {
        (CR0_PE | CR0_ET | CR0_PG, CR4_PAE, EFER_LME_LMA)
    } else {
        (CR0_PE | CR0_ET, 0, 0)
    };
    sregs.cr3 = if long { PAGE_TABLES_GPA } else { 0 };
    vcpu.set_sregs(&sregs)
        .map_err(|e| VmError::ioctl("KVM_SET_SREGS", e))
}

/// The 32-bit write routine (`as --32`, Intel syntax; offset, bytes, instruction):
/// ```text
/// 00  8b 0e                 mov ecx,DWORD PTR [esi]
/// 02  8d 7e 08              lea edi,[esi+0x8]
/// 05  e3 19                 jecxz 0x20
/// 07  8b 07                 mov eax,DWORD PTR [edi]
/// 09  3b 47 08              cmp eax,DWORD PTR [edi+0x8]
/// 0c  73 0c                 jae 0x1a
/// 0e  8d 14 18              lea edx,[eax+ebx*1]
/// 11  89 10                 mov DWORD PTR [eax],edx
/// 13  05 00 10 00 00        add eax,0x1000
/// 18  eb ef                 jmp 0x9
/// 1a  83 c7 10              add edi,0x10
/// 1d  49                    dec ecx
/// 1e  eb e5                 jmp 0x5
/// 20  89 d8                 mov eax,ebx
/// 22  e7 10                 out 0x10,eax
/// 24  43                    inc ebx
/// 25  eb d9                 jmp 0x0
/// ```
const WRITE_32: [u8; 39] = [
    0x8b, 0x0e, 0x8d, 0x7e, 0x08, 0xe3, 0x19, 0x8b, 0x07, 0x3b, 0x47, 0x08, 0x73, 0x0c, 0x8d, 0x14,
    0x18, 0x89, 0x10, 0x05, 0x00, 0x10, 0x00, 0x00, 0xeb, 0xef, 0x83, 0xc7, 0x10, 0x49, 0xeb, 0xe5,
    0x89, 0xd8, 0xe7, 0x10, 0x43, 0xeb, 0xd9,
];

/// The 32-bit verify routine (`as --32`, Intel syntax; offset, bytes, instruction):
/// ```text
/// 00  8b 0e                 mov ecx,DWORD PTR [esi]
/// 02  8d 7e 08              lea edi,[esi+0x8]
/// 05  31 ed                 xor ebp,ebp
/// 07  e3 25                 jecxz 0x6e
/// 09  8b 07                 mov eax,DWORD PTR [edi]
/// 0b  3b 47 08              cmp eax,DWORD PTR [edi+0x8]
/// 0e  73 18                 jae 0x68
/// 10  8d 14 18              lea edx,[eax+ebx*1]
/// 13  39 10                 cmp DWORD PTR [eax],edx
/// 15  74 01                 je 0x58
/// 17  45                    inc ebp
/// 18  39 90 fc 0f 00 00     cmp DWORD PTR [eax+0xffc],edx
/// 1e  74 01                 je 0x61
/// 20  45                    inc ebp
/// 21  05 00 10 00 00        add eax,0x1000
/// 26  eb e3                 jmp 0x4b
/// 28  83 c7 10              add edi,0x10
/// 2b  49                    dec ecx
/// 2c  eb d9                 jmp 0x47
/// 2e  89 e8                 mov eax,ebp
/// 30  e7 11                 out 0x11,eax
/// 32  f4                    hlt
/// 33  eb cb                 jmp 0x40
/// ```
const VERIFY_32: [u8; 53] = [
    0x8b, 0x0e, 0x8d, 0x7e, 0x08, 0x31, 0xed, 0xe3, 0x25, 0x8b, 0x07, 0x3b, 0x47, 0x08, 0x73, 0x18,
    0x8d, 0x14, 0x18, 0x39, 0x10, 0x74, 0x01, 0x45, 0x39, 0x90, 0xfc, 0x0f, 0x00, 0x00, 0x74, 0x01,
    0x45, 0x05, 0x00, 0x10, 0x00, 0x00, 0xeb, 0xe3, 0x83, 0xc7, 0x10, 0x49, 0xeb, 0xd9, 0x89, 0xe8,
    0xe7, 0x11, 0xf4, 0xeb, 0xcb,
];

/// The 64-bit write routine (`as --64`, Intel syntax; offset, bytes, instruction):
/// ```text
/// 00  48 8b 0e              mov rcx,QWORD PTR [rsi]
/// 03  48 8d 7e 08           lea rdi,[rsi+0x8]
/// 07  e3 1f                 jrcxz 0x28
/// 09  48 8b 07              mov rax,QWORD PTR [rdi]
/// 0c  48 3b 47 08           cmp rax,QWORD PTR [rdi+0x8]
/// 10  73 0d                 jae 0x1f
/// 12  8d 14 18              lea edx,[rax+rbx*1]
/// 15  89 10                 mov DWORD PTR [rax],edx
/// 17  48 05 00 10 00 00     add rax,0x1000
/// 1d  eb ed                 jmp 0xc
/// 1f  48 83 c7 10           add rdi,0x10
/// 23  48 ff c9              dec rcx
/// 26  eb df                 jmp 0x7
/// 28  89 d8                 mov eax,ebx
/// 2a  e7 10                 out 0x10,eax
/// 2c  ff c3                 inc ebx
/// 2e  eb d0                 jmp 0x0
/// ```
const WRITE_64: [u8; 48] = [
    0x48, 0x8b, 0x0e, 0x48, 0x8d, 0x7e, 0x08, 0xe3, 0x1f, 0x48, 0x8b, 0x07, 0x48, 0x3b, 0x47, 0x08,
    0x73, 0x0d, 0x8d, 0x14, 0x18, 0x89, 0x10, 0x48, 0x05, 0x00, 0x10, 0x00, 0x00, 0xeb, 0xed, 0x48,
    0x83, 0xc7, 0x10, 0x48, 0xff, 0xc9, 0xeb, 0xdf, 0x89, 0xd8, 0xe7, 0x10, 0xff, 0xc3, 0xeb, 0xd0,
];

/// The 64-bit verify routine (`as --64`, Intel syntax; offset, bytes, instruction):
/// ```text
/// 00  48 8b 0e              mov rcx,QWORD PTR [rsi]
/// 03  48 8d 7e 08           lea rdi,[rsi+0x8]
/// 07  31 ed                 xor ebp,ebp
/// 09  e3 2d                 jrcxz 0x78
/// 0b  48 8b 07              mov rax,QWORD PTR [rdi]
/// 0e  48 3b 47 08           cmp rax,QWORD PTR [rdi+0x8]
/// 12  73 1b                 jae 0x6f
/// 14  8d 14 18              lea edx,[rax+rbx*1]
/// 17  39 10                 cmp DWORD PTR [rax],edx
/// 19  74 02                 je 0x5d
/// 1b  ff c5                 inc ebp
/// 1d  39 90 fc 0f 00 00     cmp DWORD PTR [rax+0xffc],edx
/// 23  74 02                 je 0x67
/// 25  ff c5                 inc ebp
/// 27  48 05 00 10 00 00     add rax,0x1000
/// 2d  eb df                 jmp 0x4e
/// 2f  48 83 c7 10           add rdi,0x10
/// 33  48 ff c9              dec rcx
/// 36  eb d1                 jmp 0x49
/// 38  89 e8                 mov eax,ebp
/// 3a  e7 11                 out 0x11,eax
/// 3c  f4                    hlt
/// 3d  eb c1                 jmp 0x40
/// ```
const VERIFY_64: [u8; 63] = [
    0x48, 0x8b, 0x0e, 0x48, 0x8d, 0x7e, 0x08, 0x31, 0xed, 0xe3, 0x2d, 0x48, 0x8b, 0x07, 0x48, 0x3b,
    0x47, 0x08, 0x73, 0x1b, 0x8d, 0x14, 0x18, 0x39, 0x10, 0x74, 0x02, 0xff, 0xc5, 0x39, 0x90, 0xfc,
    0x0f, 0x00, 0x00, 0x74, 0x02, 0xff, 0xc5, 0x48, 0x05, 0x00, 0x10, 0x00, 0x00, 0xeb, 0xdf, 0x48,
    0x83, 0xc7, 0x10, 0x48, 0xff, 0xc9, 0xeb, 0xd1, 0x89, 0xe8, 0xe7, 0x11, 0xf4, 0xeb, 0xc1,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_tables_map_first_and_last_huge_page() {
        let t = identity_tables();
        let entry =
            |at: u64| u64::from_le_bytes(t[at as usize..at as usize + 8].try_into().unwrap());
        assert_eq!(entry(0), (PAGE_TABLES_GPA + 0x1000) | 3);
        assert_eq!(entry(0x1000), (PAGE_TABLES_GPA + 0x2000) | 3);
        assert_eq!(entry(0x2000), 0x83);
        let last_pd = 0x2000 + ((LONG64_END >> 30) - 1) * 0x1000;
        assert_eq!(entry(last_pd + 511 * 8), (LONG64_END - (2 << 20)) | 0x83);
        assert_eq!(t.len() as u64, PAGE_TABLES_BYTES);
    }

    #[test]
    fn routines_fit_before_the_next_one() {
        for mode in [GuestMode::Protected32, GuestMode::Long64] {
            let (w, v) = mode.routines();
            assert!(w.len() as u64 <= VERIFY_OFFSET);
            assert!(CODE_GPA + VERIFY_OFFSET + v.len() as u64 <= 0x2000);
        }
    }
}
