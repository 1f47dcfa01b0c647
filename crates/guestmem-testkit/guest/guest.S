/*
 * guestmem's copy of the shared kit's guest (../shared/firecracker/guest.S), with one more
 * command for moving a VM between hosts:
 *        'w': writes DIRTY_MB MiB of the region (runs of 16 pages, one every STRIDE pages,
 *             spread over the whole region) with pattern(page) ^ T, and prints
 *             "WROTE <pages>\n"; from then on 't' and 'g' expect pattern ^ T on those pages
 *             (T: the time stamp counter when 'w' came, odd: each write new bytes).
 * So a diff snapshot taken after 'w' holds exactly those pages, and a 'g' after a move
 * checks every qword: the pages the diff brought and the ones the base did.
 *
 * A tiny guest "kernel" for Firecracker on this host's PVM KVM (no Linux needed).
 *
 * Firecracker loads an ELF with no PVH note through linux-loader (PT_LOAD at p_paddr, which
 * must be >= 1 MiB, as must e_entry) and enters e_entry by the Linux 64-bit boot protocol:
 * long mode, CS.L=1, IF=0, RSP=0x8ff0, RSI=0x7000 (zero page), CR3=0x9000 with page tables
 * that identity-map guest-physical [0, 1 GiB) in 2 MiB pages (src/vmm/src/arch/x86_64/
 * regs.rs, setup_page_tables). Its IDT is empty: this guest takes no interrupts, must not
 * fault.
 *
 * On this host every guest instruction is emulated (about 0.5 us each, measured: a
 * dec/jnz loop runs 1M iterations a second; `rep stosq`/`repe scasq` 2M qwords a second),
 * so the guest fills and checks memory with string instructions, and its pattern is one
 * value per 4 KiB page: pattern(page) = page * K + C (page = the page's guest-physical
 * address), in all 512 qwords of the page. A page served from the wrong file offset, a zero
 * page, or bytes shifted within a page all show as mismatches.
 *
 *   1. fills REGION_MB MiB at REGION_BASE and prints "READY\n" on COM1 (port 0x3f8);
 *   2. waits for a byte on COM1's receiver (Firecracker feeds its stdin to it):
 *        't': one TOUCH pass: reads the first and the last qword of every page (so every
 *             page of the region is faulted in) and prints "TOUCH <n> BAD <count>\n";
 *        'g': one full PASS: compares every qword of the region (repe scasq) and prints
 *             "PASS <n> BAD <count>\n";
 *      with "FIRSTBAD <hex addr>\n" after either if count > 0; then waits again.
 *
 * The waiting puts every snapshot between passes, so the first pass after a restore reads
 * the whole region through faults.
 *
 * Built with -DBALLOON it also drives Firecracker's virtio-balloon (virtio-mmio, polled, no
 * interrupts): at boot it finds the device in the kernel command line Firecracker writes
 * ("virtio_mmio.device=4K@0x<base>:<irq>"), maps 3-4 GiB to reach it, negotiates
 * VIRTIO_F_VERSION_1 only and sets up the inflate and deflate queues; then
 *        'b': inflates sets A and B (PFNs on the inflate queue; Firecracker discards them
 *             from guest memory: MADV_DONTNEED, a UFFD_EVENT_REMOVE for a Uffd backend);
 *        'c': inflates set C;
 *        'z' / 'y': checks every qword of sets A,B / C reads zero: "ZCHECK <n> BAD <count>";
 *        'r' / 'q': writes the pattern back into sets A,B / C: "REWROTE <n>".
 * A: 256 contiguous pages at region + REGION_MB/5 MiB (one whole 1 MiB block); B: 256 pages
 * every 16 KiB from region + 2*REGION_MB/5 MiB + 12 KiB; C: 256 pages every 20 KiB from
 * region + 3*REGION_MB/5 MiB + 20 KiB (single pages inside blocks).
 */
#ifndef REGION_BASE
#define REGION_BASE 0x4000000           /* 64 MiB */
#endif
#ifndef REGION_MB
#define REGION_MB 512                   /* ends at 576 MiB, inside the 1 GiB mapped */
#endif
#define REGION_END (REGION_BASE + REGION_MB * 0x100000)
#ifndef DIRTY_MB
#define DIRTY_MB 64
#endif
#define RUN_PAGES 16
#define STRIDE_PAGES (RUN_PAGES * REGION_MB / DIRTY_MB)  /* a power of two */
#define COM1 0x3f8
#define K 0x9E3779B97F4A7C15
#define C 0x5A17C0DEDEADBEEF

    .intel_syntax noprefix
    .code64
    .section .text.boot, "ax"
    .globl _start
_start:
    cli
    cld
    lea rsp, [rip + stack_top]
    lea rsi, [rip + msg_boot]
    call puts

    /* fill: rdi walks the region; rax = pattern of the current page; rdx = K * 4096 */
    mov rdi, REGION_BASE
    call pattern                        /* rax = pattern(rdi) */
    call kstep                          /* rdx = K * 4096 */
1:  mov ecx, 512
    rep stosq                           /* rdi += 4096 */
    add rax, rdx
    cmp rdi, REGION_END
    jb 1b

#ifdef BALLOON
    call vb_init
#endif
    lea rsi, [rip + msg_ready]
    call puts
    xor r15, r15                        /* pass number */
    xor r14, r14                        /* 1 once 'w' has written the dirty pages */

wait_cmd:
    call getc
    cmp al, 't'
    je touch
    cmp al, 'g'
    je full
    cmp al, 'w'
    je dirty
#ifdef BALLOON
    lea rbx, [rip + set_ab]
    cmp al, 'b'
    je vb_cmd_inflate
    cmp al, 'z'
    je vb_cmd_zcheck
    cmp al, 'r'
    je vb_cmd_rewrite
    lea rbx, [rip + set_c]
    cmp al, 'c'
    je vb_cmd_inflate
    cmp al, 'y'
    je vb_cmd_zcheck
    cmp al, 'q'
    je vb_cmd_rewrite
#endif
    jmp wait_cmd

/* TOUCH: first and last qword of every page. */
touch:
    inc r15
    xor r12, r12                        /* mismatches */
    xor r13, r13                        /* first bad address */
    mov rsi, REGION_BASE
    mov rdi, rsi
    call pattern
    call kstep
    mov r9, rax
2:  mov rdi, rsi
    call expect
    cmp [rsi], rax
    jne 4f
3:  cmp [rsi + 4088], rax
    jne 5f
6:  add r9, rdx
    add rsi, 4096
    cmp rsi, REGION_END
    jb 2b
    lea rsi, [rip + msg_touch]
    jmp report
4:  lea r8, [rsi]
    call bad
    jmp 3b
5:  lea r8, [rsi + 4088]
    call bad
    jmp 6b

/* PASS: every qword, repe scasq per page, counting every mismatching qword. */
full:
    inc r15
    xor r12, r12
    xor r13, r13
    mov rdi, REGION_BASE
    call pattern
    call kstep
    mov r9, rax
7:  call expect
    mov ecx, 512
8:  repe scasq                          /* stops after a mismatch, or at the page end */
    je 9f                               /* the last compared qword matched: page done */
    lea r8, [rdi - 8]
    call bad
    test ecx, ecx
    jnz 8b                              /* go on from the qword after the mismatch */
9:  add r9, rdx
    cmp rdi, REGION_END
    jb 7b
    lea rsi, [rip + msg_pass]
    jmp report

/* WRITE: the dirty set gets pattern ^ T (r14); prints "WROTE <pages>". */
dirty:
    inc r15
    rdtsc                               /* this write's mask: new bytes every time */
    shl rdx, 32
    or rax, rdx
    or rax, 1
    mov r14, rax
    xor r12, r12
    mov rdi, REGION_BASE
    call pattern
    call kstep
    mov r9, rax
1:  call in_dirty_set
    jae 2f
    mov rax, r9
    xor rax, r14
    mov ecx, 512
    rep stosq                           /* rdi += 4096 */
    inc r12
    jmp 3f
2:  add rdi, 4096
3:  add r9, rdx
    cmp rdi, REGION_END
    jb 1b
    lea rsi, [rip + msg_wrote]
    call puts
    mov rax, r12
    call putdec
    mov al, '\n'
    call putc
    jmp wait_cmd

/* in_dirty_set: CF set when the page at rdi is one 'w' writes. */
in_dirty_set:
    push rbx
    mov rbx, rdi
    sub rbx, REGION_BASE
    shr rbx, 12
    and rbx, STRIDE_PAGES - 1
    cmp rbx, RUN_PAGES
    pop rbx
    ret

/* expect: rax = what the page at rdi holds: r9 (its pattern), ^ r14 once 'w' wrote it. */
expect:
    mov rax, r9
    test r14, r14
    jz 1f
    call in_dirty_set
    jae 1f
    xor rax, r14
1:  ret

/* report: rsi = "TOUCH " or "PASS "; prints "<rsi><n> BAD <count>\n" [+ FIRSTBAD]. */
report:
    call puts
    mov rax, r15
    call putdec
    lea rsi, [rip + msg_bad]
    call puts
    mov rax, r12
    call putdec
    mov al, '\n'
    call putc
    test r12, r12
    jz wait_cmd
    lea rsi, [rip + msg_firstbad]
    call puts
    mov rax, r13
    call puthex
    mov al, '\n'
    call putc
    jmp wait_cmd


#ifdef BALLOON
/* ---- virtio-balloon over virtio-mmio, polled ---- */
#define VQ_SIZE 16
#define MMIO_WINDOW 0xC0000000          /* Firecracker's 32-bit MMIO space: 3-4 GiB */

/* vb_init: find, map and set up the balloon; prints BALLOON ... or NOBALLOON. */
vb_init:
    /* map [3 GiB, 4 GiB) with 2 MiB uncached pages: PDPT (0xa000, Firecracker's) entry 3 */
    lea rdi, [rip + vb_pd]
    mov rax, MMIO_WINDOW | 0x9b         /* P RW PWT PCD PS */
    mov ecx, 512
1:  mov [rdi], rax
    add rax, 0x200000
    add rdi, 8
    dec ecx
    jnz 1b
    lea rax, [rip + vb_pd]
    or rax, 3
    mov [0xa000 + 3 * 8], rax
    mov rax, cr3
    mov cr3, rax
    /* find "virtio_mmio.device=" in the command line at 0x20000 */
    mov rsi, 0x20000
2:  cmp byte ptr [rsi], 0
    je 9f
    lea rdi, [rip + str_vmmio]
    mov rdx, rsi
3:  mov al, [rdi]
    test al, al
    jz 4f                               /* whole key matched */
    cmp al, [rdx]
    jne 5f
    inc rdi
    inc rdx
    jmp 3b
5:  inc rsi
    jmp 2b
4:  cmp byte ptr [rdx], '@'             /* skip "4K" to '@', then "0x" */
    je 6f
    cmp byte ptr [rdx], 0
    je 9f
    inc rdx
    jmp 4b
6:  add rdx, 3
    xor rax, rax
7:  movzx ecx, byte ptr [rdx]
    sub ecx, '0'
    cmp ecx, 9
    jbe 8f
    movzx ecx, byte ptr [rdx]
    or ecx, 0x20
    sub ecx, 'a'
    cmp ecx, 5
    ja 10f
    add ecx, 10
8:  shl rax, 4
    or rax, rcx
    inc rdx
    jmp 7b
10: mov [rip + vb_base], rax
    mov rbx, rax
    /* identify */
    cmp dword ptr [rbx], 0x74726976     /* "virt" */
    jne 11f
    cmp dword ptr [rbx + 8], 5          /* balloon */
    jne 11f
    mov dword ptr [rbx + 0x70], 0       /* reset */
    mov dword ptr [rbx + 0x70], 1       /* ACKNOWLEDGE */
    mov dword ptr [rbx + 0x70], 3       /* DRIVER */
    mov dword ptr [rbx + 0x14], 1       /* device features, high half */
    mov eax, [rbx + 0x10]
    shl rax, 32
    mov dword ptr [rbx + 0x14], 0
    mov ecx, [rbx + 0x10]
    or rax, rcx
    mov [rip + vb_features], rax
    mov dword ptr [rbx + 0x24], 0       /* driver features: VERSION_1 (bit 32) only */
    mov dword ptr [rbx + 0x20], 0
    mov dword ptr [rbx + 0x24], 1
    mov dword ptr [rbx + 0x20], 1
    mov dword ptr [rbx + 0x70], 0xb     /* FEATURES_OK */
    /* queues 0 (inflate) and 1 (deflate) */
    xor r8, r8
12: mov [rbx + 0x30], r8d
    mov dword ptr [rbx + 0x38], VQ_SIZE
    mov rax, r8
    shl rax, 10                         /* 1 KiB per queue in vb_vq */
    lea rdi, [rip + vb_vq]
    add rdi, rax
    mov [rbx + 0x80], edi               /* descriptors: +0 */
    mov dword ptr [rbx + 0x84], 0
    lea rax, [rdi + 256]                /* avail: +256 */
    mov [rbx + 0x90], eax
    mov dword ptr [rbx + 0x94], 0
    lea rax, [rdi + 512]                /* used: +512 */
    mov [rbx + 0xa0], eax
    mov dword ptr [rbx + 0xa4], 0
    mov dword ptr [rbx + 0x44], 1       /* ready */
    inc r8
    cmp r8, 2
    jb 12b
    mov dword ptr [rbx + 0x70], 0xf     /* DRIVER_OK */
    lea rsi, [rip + msg_balloon]
    call puts
    mov rax, rbx
    call puthex
    lea rsi, [rip + msg_features]
    call puts
    mov rax, [rip + vb_features]
    call puthex
    lea rsi, [rip + msg_status]
    call puts
    mov eax, [rbx + 0x70]
    call puthex
    mov al, '\n'
    call putc
    ret
11: lea rsi, [rip + msg_baddev]
    call puts
    ret
9:  lea rsi, [rip + msg_noballoon]
    call puts
    ret

/* A set: {u64 first page address, u64 pages, u64 stride bytes}; a list ends with pages 0. */

/* 'b' / 'c': inflate every set of the list at rbx, one descriptor each; waits for each. */
vb_cmd_inflate:
    xor r12, r12                        /* pages */
1:  mov rcx, [rbx + 8]
    test rcx, rcx
    jz 5f
    mov rax, [rbx]
    mov rdx, [rbx + 16]
    lea rdi, [rip + vb_pfns]
    mov r9, rcx
2:  mov r8, rax
    shr r8, 12
    mov [rdi], r8d
    add rdi, 4
    add rax, rdx
    dec rcx
    jnz 2b
    add r12, r9
    /* descriptor slot = avail idx % VQ_SIZE */
    lea r10, [rip + vb_vq]              /* queue 0 */
    movzx r11, word ptr [r10 + 256 + 2]
    mov rax, r11
    and rax, VQ_SIZE - 1
    mov rdx, rax
    shl rdx, 4
    lea rdi, [rip + vb_pfns]
    mov [r10 + rdx], rdi                /* addr */
    shl r9, 2
    mov [r10 + rdx + 8], r9d            /* len: 4 bytes a PFN */
    mov word ptr [r10 + rdx + 12], 0    /* flags: device reads it */
    mov word ptr [r10 + rdx + 14], 0
    mov [r10 + 256 + 4 + rax * 2], ax   /* avail ring entry: the slot */
    mfence
    inc r11
    mov [r10 + 256 + 2], r11w           /* avail idx */
    mfence
    mov rax, [rip + vb_base]
    mov dword ptr [rax + 0x50], 0       /* notify queue 0 */
3:  mov ecx, 2000
4:  pause
    dec ecx
    jnz 4b
    cmp [r10 + 512 + 2], r11w           /* used idx caught up? */
    jne 3b
    add rbx, 24
    jmp 1b
5:  lea rsi, [rip + msg_inflated]
    call puts
    mov rax, r12
    call putdec
    mov al, '\n'
    call putc
    jmp wait_cmd

/* 'z' / 'y': every qword of every page of the sets at rbx must read zero. */
vb_cmd_zcheck:
    xor r12, r12
    xor r13, r13
1:  mov r9, [rbx + 8]
    test r9, r9
    jz 5f
    mov rdi, [rbx]
2:  mov rdx, rdi
    xor eax, eax
    mov ecx, 512
3:  repe scasq
    je 4f
    lea r8, [rdi - 8]
    call bad
    test ecx, ecx
    jnz 3b
4:  mov rdi, rdx
    add rdi, [rbx + 16]
    dec r9
    jnz 2b
    add rbx, 24
    jmp 1b
5:  inc r15
    lea rsi, [rip + msg_zcheck]
    jmp report

/* 'r' / 'q': the pattern back into every page of the sets at rbx. */
vb_cmd_rewrite:
    xor r12, r12
1:  mov r9, [rbx + 8]
    test r9, r9
    jz 5f
    mov rdi, [rbx]
2:  mov rdx, rdi
    call pattern
    mov ecx, 512
    rep stosq
    mov rdi, rdx
    add rdi, [rbx + 16]
    inc r12
    dec r9
    jnz 2b
    add rbx, 24
    jmp 1b
5:  lea rsi, [rip + msg_rewrote]
    call puts
    mov rax, r12
    call putdec
    mov al, '\n'
    call putc
    jmp wait_cmd
#endif

/* bad: counts a mismatch at r8 (r12), keeping the first address (r13). */
bad:
    test r12, r12
    jnz 1f
    mov r13, r8
1:  inc r12
    ret

/* pattern: rax = rdi * K + C. */
pattern:
    push rdx
    movabs rax, K
    imul rax, rdi
    movabs rdx, C
    add rax, rdx
    pop rdx
    ret

/* kstep: rdx = K * 4096 (the pattern's step from one page to the next). */
kstep:
    movabs rdx, K
    shl rdx, 12
    ret

/* putc: al -> COM1 (Firecracker's 8250 is always ready to send). */
putc:
    push rdx
    mov dx, COM1
    out dx, al
    pop rdx
    ret

/* puts: NUL-terminated string at rsi. */
puts:
    push rax
1:  mov al, [rsi]
    test al, al
    jz 2f
    call putc
    inc rsi
    jmp 1b
2:  pop rax
    ret

/* getc: polls COM1's line status (data ready, bit 0) and returns the byte in al. */
getc:
    push rdx
    push rcx
1:  mov ecx, 2000                       /* spin between polls (each poll is a VM exit) */
2:  pause
    dec ecx
    jnz 2b
    mov dx, COM1 + 5
    in al, dx
    test al, 1
    jz 1b
    mov dx, COM1
    in al, dx
    pop rcx
    pop rdx
    ret

/* putdec: rax in decimal. */
putdec:
    push rbx
    push rcx
    push rdx
    lea rbx, [rip + numbuf_end]
    mov rcx, 10
1:  xor rdx, rdx
    div rcx
    add dl, '0'
    dec rbx
    mov [rbx], dl
    test rax, rax
    jnz 1b
    mov rsi, rbx
    call puts
    pop rdx
    pop rcx
    pop rbx
    ret

/* puthex: rax as 0x + 16 hex digits. */
puthex:
    push rbx
    push rcx
    mov rbx, rax
    mov al, '0'
    call putc
    mov al, 'x'
    call putc
    mov ecx, 16
1:  rol rbx, 4
    mov al, bl
    and al, 0xf
    add al, '0'
    cmp al, '9'
    jbe 2f
    add al, 'a' - '9' - 1
2:  call putc
    dec ecx
    jnz 1b
    pop rcx
    pop rbx
    ret

    .section .rodata
msg_boot:     .asciz "BOOT\n"
msg_ready:    .asciz "READY\n"
msg_touch:    .asciz "TOUCH "
msg_pass:     .asciz "PASS "
msg_bad:      .asciz " BAD "
msg_firstbad: .asciz "FIRSTBAD "
msg_wrote:    .asciz "WROTE "
#ifdef BALLOON
msg_balloon:  .asciz "BALLOON at "
msg_features: .asciz " features "
msg_status:   .asciz " status "
msg_baddev:   .asciz "BALLOON not a virtio balloon\n"
msg_noballoon: .asciz "NOBALLOON\n"
msg_inflated: .asciz "INFLATED "
msg_zcheck:   .asciz "ZCHECK "
msg_rewrote:  .asciz "REWROTE "
str_vmmio:    .asciz "virtio_mmio.device="
    .balign 8
set_ab:       .quad REGION_BASE + ((REGION_MB / 5) << 20), 256, 4096
              .quad REGION_BASE + ((2 * REGION_MB / 5) << 20) + 3 * 4096, 256, 4 * 4096
              .quad 0, 0, 0
set_c:        .quad REGION_BASE + ((3 * REGION_MB / 5) << 20) + 5 * 4096, 256, 5 * 4096
              .quad 0, 0, 0
#endif

    .section .data
numbuf:       .fill 24, 1, 0
numbuf_end:   .byte 0

    .section .bss
    .balign 4096
stack:        .skip 16384
stack_top:
#ifdef BALLOON
    .balign 4096
vb_pd:        .skip 4096
vb_vq:        .skip 2048                /* queue 0 at +0, queue 1 at +1024 */
vb_pfns:      .skip 1024
vb_base:      .skip 8
vb_features:  .skip 8
#endif
