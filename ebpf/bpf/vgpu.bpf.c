// SPDX-License-Identifier: GPL-2.0
/* The vgpu eBPF programs: the GPU device gate (cgroup/dev), the process-exit watcher
 * (tracepoint sched/sched_process_exit) and the exec hook that drops a registration when
 * its process runs a new program (sched/sched_process_exec), sharing their maps. Loaded by
 * src/enforcer.rs. */
#include <linux/bpf.h>
#include <bpf/bpf_helpers.h>
#include <bpf/bpf_core_read.h>
#include "vgpu_ebpf.h"

/* CO-RE: the two kernel fields the exit program reads, relocated against the running
 * kernel's BTF at load time (no generated vmlinux.h needed). */
typedef struct {
	int counter;
} vgpu_atomic_t;

struct signal_struct {
	vgpu_atomic_t live;
} __attribute__((preserve_access_index));

struct task_struct {
	struct signal_struct *signal;
} __attribute__((preserve_access_index));

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 256);
	__type(key, struct vgpu_dev_key);
	__type(value, __u8);
} vgpu_gpu_devices SEC(".maps");

/* 1 for every major that has an entry in vgpu_gpu_devices: an array lookup (inlined by the
 * verifier) lets every other device through without hashing. */
struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, VGPU_MAJORS);
	__type(key, __u32);
	__type(value, __u8);
} vgpu_gpu_majors SEC(".maps");

/* Thread-group ids the daemon registered (host pid namespace). Removed here at exit. */
struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u8);
} vgpu_allowed_tgids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_HASH);
	__uint(max_entries, 1024);
	__type(key, __u64);
	__type(value, __u8);
} vgpu_trusted_cgroups SEC(".maps");

/* Processes whose exit is reported: those the daemon watches and every process that opened
 * a GPU node through the gate (LRU: a full map forgets the oldest, never refuses). */
struct {
	__uint(type, BPF_MAP_TYPE_LRU_HASH);
	__uint(max_entries, 65536);
	__type(key, __u32);
	__type(value, __u8);
} vgpu_watched_tgids SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, VGPU_CONFIG_LEN);
	__type(key, __u32);
	__type(value, __u32);
} vgpu_config SEC(".maps");

struct {
	__uint(type, BPF_MAP_TYPE_ARRAY);
	__uint(max_entries, VGPU_COUNTER_LEN);
	__type(key, __u32);
	__type(value, __u64);
} vgpu_counters SEC(".maps");

/* Gate events (refused and audited opens): a tenant can flood these. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} vgpu_events SEC(".maps");

/* Exit events, apart so that no flood of refusals can crowd them out. */
struct {
	__uint(type, BPF_MAP_TYPE_RINGBUF);
	__uint(max_entries, 256 * 1024);
} vgpu_exit_events SEC(".maps");

static __always_inline void count(__u32 index)
{
	__u64 *value = bpf_map_lookup_elem(&vgpu_counters, &index);

	if (value)
		__sync_fetch_and_add(value, 1);
}

static __always_inline void emit(void *ring, __u32 lost_counter, __u32 kind, __u64 pid_tgid,
				 __u32 major, __u32 minor, __u32 access)
{
	struct vgpu_event *event = bpf_ringbuf_reserve(ring, sizeof(*event), 0);

	if (!event) {
		count(lost_counter);
		return;
	}
	event->kind = kind;
	event->tgid = pid_tgid >> 32;
	event->pid = (__u32)pid_tgid;
	event->major = major;
	event->minor = minor;
	event->access = access;
	event->cgroup_id = bpf_get_current_cgroup_id();
	event->time_ns = bpf_ktime_get_ns();
	if (bpf_get_current_comm(event->comm, sizeof(event->comm)))
		event->comm[0] = 0;
	bpf_ringbuf_submit(event, 0);
}

/* A lookup first: most opens come from a process already watched, and an LRU update
 * costs far more than a lookup. */
static __always_inline void watch(__u32 tgid)
{
	__u8 one = 1;

	if (!bpf_map_lookup_elem(&vgpu_watched_tgids, &tgid))
		bpf_map_update_elem(&vgpu_watched_tgids, &tgid, &one, BPF_ANY);
}

/* Returns 1 (allow) or 0 (the kernel answers EPERM). */
SEC("cgroup/dev")
int vgpu_gate(struct bpf_cgroup_dev_ctx *ctx)
{
	__u32 type = ctx->access_type & 0xffff;
	struct vgpu_dev_key key = { .major = ctx->major, .minor = ctx->minor };

	/* Creating a node (mknod: runc does it inside the container's cgroup) grants nothing;
	 * opening it for reading or writing is what the gate judges. */
	if (type != BPF_DEVCG_DEV_CHAR ||
	    !((ctx->access_type >> 16) & (BPF_DEVCG_ACC_READ | BPF_DEVCG_ACC_WRITE)))
		return 1;
	__u32 major = ctx->major;
	__u8 *gpu_major = bpf_map_lookup_elem(&vgpu_gpu_majors, &major);

	if (!gpu_major || !*gpu_major)
		return 1;
	if (!bpf_map_lookup_elem(&vgpu_gpu_devices, &key)) {
		key.minor = VGPU_ANY_MINOR;
		if (!bpf_map_lookup_elem(&vgpu_gpu_devices, &key))
			return 1;
	}

	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if (bpf_map_lookup_elem(&vgpu_allowed_tgids, &tgid)) {
		watch(tgid);
		return 1;
	}
	__u64 cgroup_id = bpf_get_current_cgroup_id();

	if (bpf_map_lookup_elem(&vgpu_trusted_cgroups, &cgroup_id))
		return 1;

	__u32 mode_key = VGPU_CONFIG_MODE;
	__u32 *mode = bpf_map_lookup_elem(&vgpu_config, &mode_key);

	if (mode && *mode == VGPU_MODE_AUDIT) {
		count(VGPU_COUNTER_AUDITED);
		emit(&vgpu_events, VGPU_COUNTER_LOST, VGPU_EVENT_AUDITED, pid_tgid, ctx->major, ctx->minor, ctx->access_type);
		watch(tgid);
		return 1;
	}
	count(VGPU_COUNTER_REFUSED);
	emit(&vgpu_events, VGPU_COUNTER_LOST, VGPU_EVENT_REFUSED, pid_tgid, ctx->major, ctx->minor, ctx->access_type);
	return 0;
}

/* Reports the end of a watched process: the exit of its last thread (signal->live has
 * already dropped to 0 when the tracepoint fires). Forgets its registration so that a
 * recycled pid never inherits GPU access. */
SEC("tracepoint/sched/sched_process_exit")
int vgpu_exit(void *ctx)
{
	__u64 pid_tgid = bpf_get_current_pid_tgid();
	__u32 tgid = pid_tgid >> 32;

	if (!bpf_map_lookup_elem(&vgpu_watched_tgids, &tgid) &&
	    !bpf_map_lookup_elem(&vgpu_allowed_tgids, &tgid))
		return 0;

	struct task_struct *task = (struct task_struct *)bpf_get_current_task();
	int live = BPF_CORE_READ(task, signal, live.counter);

	if (live != 0)
		return 0;
	bpf_map_delete_elem(&vgpu_allowed_tgids, &tgid);
	bpf_map_delete_elem(&vgpu_watched_tgids, &tgid);
	count(VGPU_COUNTER_EXITS);
	emit(&vgpu_exit_events, VGPU_COUNTER_EXIT_LOST, VGPU_EVENT_EXIT, pid_tgid, 0, 0, 0);
	return 0;
}

/* A registered process that executes a new program loses its registration: the new image
 * registers again through the shim (cuInit/nvmlInit) if it loads it, and a static or
 * shim-less binary exec'd by a registered wrapper is refused like any other. */
SEC("tracepoint/sched/sched_process_exec")
int vgpu_exec(void *ctx)
{
	__u32 tgid = bpf_get_current_pid_tgid() >> 32;

	bpf_map_delete_elem(&vgpu_allowed_tgids, &tgid);
	return 0;
}

char LICENSE[] SEC("license") = "GPL";
