/* Exported dlsym. Asks gpuslice_dlsym_filter first; when it does not handle
   the lookup (RTLD_NEXT / RTLD_DEFAULT), tail-jumps to glibc's dlsym so that
   glibc sees the original caller's return address. See dlsym.cc. */
#if defined(__x86_64__)
    .text
    .globl  dlsym
    .type   dlsym, @function
    .p2align 4
dlsym:
    .cfi_startproc
    endbr64
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
    jz      1f
    ret
1:
    jmp     *gpuslice_real_dlsym(%rip)
    .cfi_endproc
    .size   dlsym, .-dlsym
#endif
    .section .note.GNU-stack,"",@progbits
