/* The fast paths of the four launch entry points whose arguments spill onto
   the stack (cuLaunchKernel and cuLaunchCooperativeKernel, both with _ptsz):
   launch_wrappers.cc's kernel_fast() in nine instructions, then a tail jump
   to the driver with every argument where the caller put it. GCC copies the
   stack arguments through registers around such a tail call (35 instructions,
   counted by gpuslice-instructions). Anything but the fast path jumps to the
   function's slow twin (launch_wrappers.cc), which decides as before.
   What is read, and why a plain load is enough (x86-64 loads are acquire):
     bit 0 of hook::g_kernel_check   a CUkernel may wait to be placed (modules.h)
     hook::launch::g_mode            kModeUnlimited (1) or not (launch_state.h)
     hook::launch::t_unlimited_launches  the thread's count; its low byte
                                     wrapping to 0 is the turn to read the
                                     limits again (kRecheckEvery = 256,
                                     static_asserted in launch_wrappers.cc)
   %rax is free at entry of a function that is not variadic. */
#if defined(__x86_64__)
#define KERNEL_CHECK _ZN8gpuslice4hook14g_kernel_checkE
#define MODE _ZN8gpuslice4hook6launch6g_modeE
#define LAUNCHES _ZN8gpuslice4hook6launch20t_unlimited_launchesE

    .macro fast_launch name, real, slow
    .text
    .globl  \name
    .type   \name, @function
    .p2align 4
\name:
    .cfi_startproc
#if defined(__CET__)
    endbr64
#endif
    testb   $1, KERNEL_CHECK(%rip)
    jne     1f
    cmpl    $1, MODE(%rip)
    jne     1f
    movq    LAUNCHES@GOTTPOFF(%rip), %rax
    addb    $1, %fs:(%rax)
    je      1f
    jmp     *\real(%rip)
1:  jmp     \slow
    .cfi_endproc
    .size   \name, .-\name
    .endm

    fast_launch cuLaunchKernel, _ZN8gpuslice4hook19real_cuLaunchKernelE, gpuslice_cuLaunchKernel_slow
    fast_launch cuLaunchKernel_ptsz, _ZN8gpuslice4hook24real_cuLaunchKernel_ptszE, gpuslice_cuLaunchKernel_ptsz_slow
    fast_launch cuLaunchCooperativeKernel, _ZN8gpuslice4hook30real_cuLaunchCooperativeKernelE, gpuslice_cuLaunchCooperativeKernel_slow
    fast_launch cuLaunchCooperativeKernel_ptsz, _ZN8gpuslice4hook35real_cuLaunchCooperativeKernel_ptszE, gpuslice_cuLaunchCooperativeKernel_ptsz_slow
#endif
    .section .note.GNU-stack,"",@progbits
