/* Exported dlsym (see dlsym.cc).
   RTLD_NEXT / RTLD_DEFAULT: tail-jump to glibc's dlsym so glibc sees the
   original caller's return address — entirely in assembly, because sanitizer
   runtimes call dlsym(RTLD_NEXT, ...) during their own initialisation, before
   any instrumented code (ours included) may run.
   Explicit handles: ask gpuslice_dlsym_filter, which may return a wrapper. */
#if defined(__x86_64__)
    .text
    .globl  dlsym
    .type   dlsym, @function
    .p2align 4
dlsym:
    .cfi_startproc
    endbr64
    cmpq    $-1, %rdi                  /* RTLD_NEXT */
    je      .Lpass
    testq   %rdi, %rdi                 /* RTLD_DEFAULT */
    je      .Lpass
    pushq   %rdi
    .cfi_adjust_cfa_offset 8
    pushq   %rsi
    .cfi_adjust_cfa_offset 8
    subq    $24, %rsp                  /* 16-byte aligned call, room for `handled` */
    .cfi_adjust_cfa_offset 24
    leaq    (%rsp), %rdx
    call    gpuslice_dlsym_filter
    movl    (%rsp), %ecx
    addq    $24, %rsp
    .cfi_adjust_cfa_offset -24
    popq    %rsi
    .cfi_adjust_cfa_offset -8
    popq    %rdi
    .cfi_adjust_cfa_offset -8
    testl   %ecx, %ecx
    jz      .Lpass
    ret
.Lpass:
    movq    gpuslice_real_dlsym(%rip), %rax
    testq   %rax, %rax
    jnz     1f
    pushq   %rdi
    .cfi_adjust_cfa_offset 8
    pushq   %rsi
    .cfi_adjust_cfa_offset 8
    subq    $8, %rsp
    .cfi_adjust_cfa_offset 8
    call    gpuslice_resolve_real_dlsym
    addq    $8, %rsp
    .cfi_adjust_cfa_offset -8
    popq    %rsi
    .cfi_adjust_cfa_offset -8
    popq    %rdi
    .cfi_adjust_cfa_offset -8
    testq   %rax, %rax
    jz      2f                         /* no glibc dlsym: answer NULL */
1:
    jmp     *%rax
2:
    ret
    .cfi_endproc
    .size   dlsym, .-dlsym

/* void* gpuslice_resolve_real_dlsym(void): glibc's dlsym, found with dlvsym
   by version so that our own export is skipped (2.34 moved it into libc;
   older glibc only has 2.2.5). Stores and returns it. No instrumented code. */
    .globl  gpuslice_resolve_real_dlsym
    .hidden gpuslice_resolve_real_dlsym
    .type   gpuslice_resolve_real_dlsym, @function
    .p2align 4
gpuslice_resolve_real_dlsym:
    .cfi_startproc
    endbr64
    subq    $8, %rsp
    .cfi_adjust_cfa_offset 8
    movq    $-1, %rdi
    leaq    .Lname(%rip), %rsi
    leaq    .Lv234(%rip), %rdx
    call    dlvsym@PLT
    testq   %rax, %rax
    jnz     1f
    movq    $-1, %rdi
    leaq    .Lname(%rip), %rsi
    leaq    .Lv225(%rip), %rdx
    call    dlvsym@PLT
1:
    movq    %rax, gpuslice_real_dlsym(%rip)
    addq    $8, %rsp
    .cfi_adjust_cfa_offset -8
    ret
    .cfi_endproc
    .size   gpuslice_resolve_real_dlsym, .-gpuslice_resolve_real_dlsym

    .section .rodata
.Lname: .asciz "dlsym"
.Lv234: .asciz "GLIBC_2.34"
.Lv225: .asciz "GLIBC_2.2.5"
#endif
    .section .note.GNU-stack,"",@progbits
