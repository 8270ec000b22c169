/* Types shared by the eBPF programs (vgpu.bpf.c) and the Rust loader (src/abi.rs): one home
 * for the kernel boundary. Any change here changes the layout test (tests/layout.rs) and
 * must bump VGPU_EBPF_ABI_VERSION; pinned maps of another version are not reused. */
#ifndef VGPU_EBPF_H
#define VGPU_EBPF_H

#include <linux/types.h>

#define VGPU_EBPF_ABI_VERSION 1

/* vgpu_config[VGPU_CONFIG_MODE]: what the gate does with an unregistered GPU open. Any value
 * other than VGPU_MODE_AUDIT enforces (a zeroed or corrupted map fails closed). */
#define VGPU_CONFIG_MODE 0
#define VGPU_CONFIG_ABI 1
#define VGPU_CONFIG_LEN 2
#define VGPU_MODE_ENFORCE 0
#define VGPU_MODE_AUDIT 1

/* Majors are 12 bits (MAJOR() of a dev_t): vgpu_gpu_majors has one entry per major. */
#define VGPU_MAJORS 4096

/* A GPU device key with this minor matches every minor of the major (nvidia-uvm, caps). */
#define VGPU_ANY_MINOR 0xffffffffu

/* vgpu_counters indices. */
#define VGPU_COUNTER_LOST 0     /* gate events dropped: vgpu_events full */
#define VGPU_COUNTER_REFUSED 1  /* GPU opens refused (enforce) */
#define VGPU_COUNTER_AUDITED 2  /* GPU opens that enforce would refuse (audit) */
#define VGPU_COUNTER_EXITS 3    /* exit events emitted */
#define VGPU_COUNTER_EXIT_LOST 4 /* exit events dropped: vgpu_exit_events full */
#define VGPU_COUNTER_LEN 5

/* vgpu_event.kind */
#define VGPU_EVENT_REFUSED 1
#define VGPU_EVENT_AUDITED 2
#define VGPU_EVENT_EXIT 3

struct vgpu_dev_key {
	__u32 major;
	__u32 minor;
};

/* One record in the vgpu_events ring buffer. For exits, major/minor/access are 0. */
struct vgpu_event {
	__u32 kind;
	__u32 tgid;
	__u32 pid;
	__u32 major;
	__u32 minor;
	__u32 access; /* bpf_cgroup_dev_ctx.access_type: type (low 16 bits) | access (high) */
	__u64 cgroup_id;
	__u64 time_ns; /* bpf_ktime_get_ns(): CLOCK_MONOTONIC */
	char comm[16];
};

#endif
