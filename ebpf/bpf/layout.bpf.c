// SPDX-License-Identifier: GPL-2.0
/* The C compiler's view of the shared types, as numbers in .rodata: tests/layout.rs reads
 * `vgpu_layout` from this object and compares it with the Rust #[repr(C)] types. */
#include <stddef.h>
#include "vgpu_ebpf.h"

#define SIZE_OFF(type, field) offsetof(struct type, field), sizeof(((struct type *)0)->field)

const volatile __u64 vgpu_layout[] = {
	VGPU_EBPF_ABI_VERSION,
	sizeof(struct vgpu_dev_key),
	SIZE_OFF(vgpu_dev_key, major),
	SIZE_OFF(vgpu_dev_key, minor),
	sizeof(struct vgpu_event),
	SIZE_OFF(vgpu_event, kind),
	SIZE_OFF(vgpu_event, tgid),
	SIZE_OFF(vgpu_event, pid),
	SIZE_OFF(vgpu_event, major),
	SIZE_OFF(vgpu_event, minor),
	SIZE_OFF(vgpu_event, access),
	SIZE_OFF(vgpu_event, cgroup_id),
	SIZE_OFF(vgpu_event, time_ns),
	SIZE_OFF(vgpu_event, comm),
	VGPU_CONFIG_MODE, VGPU_CONFIG_ABI, VGPU_CONFIG_LEN, VGPU_MODE_ENFORCE, VGPU_MODE_AUDIT,
	VGPU_ANY_MINOR, VGPU_MAJORS,
	VGPU_COUNTER_LOST, VGPU_COUNTER_REFUSED, VGPU_COUNTER_AUDITED, VGPU_COUNTER_EXITS,
	VGPU_COUNTER_EXIT_LOST, VGPU_COUNTER_LEN,
	VGPU_EVENT_REFUSED, VGPU_EVENT_AUDITED, VGPU_EVENT_EXIT,
};
