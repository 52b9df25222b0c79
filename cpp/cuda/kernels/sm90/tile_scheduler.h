// The order in which the persistent sm90 forward's CTAs take their work items (one item: a block of query rows of one
// (batch, head)). The grid has one CTA per SM; CTA c takes items c, c + grid, c + 2 grid, ..., so while it finishes one
// item its producer already loads the next one's q and k.
//
// Items are numbered in sections of (batch, head) pairs whose k and v fit in L2 together. Inside a section the query
// block is the outer index, counted down: every CTA takes the last blocks (the most keys under causal masks) first,
// items running at the same time cost alike, and they walk the same few (batch, head) pairs' keys in step, so each k and
// v tile comes from memory once per section and from L2 after that.
#pragma once

#include "cpp/host_device.h"

namespace te_jax::cuda::sm90 {

struct ForwardWork {
  int m_block, head, b;
};

struct ForwardSchedule {
  int m_blocks;       // query blocks per (batch, head)
  int heads;          // query heads
  int pairs;          // batch * heads
  int section_pairs;  // (batch, head) pairs per section, >= 1

  TE_JAX_HOST_DEVICE int Items() const { return m_blocks * pairs; }

  TE_JAX_HOST_DEVICE ForwardWork Item(int w) const {
    const int first_pair = w / (section_pairs * m_blocks) * section_pairs;
    const int in_section = w - first_pair * m_blocks;
    const int section_size = pairs - first_pair < section_pairs ? pairs - first_pair : section_pairs;  // the last is short
    const int pair = first_pair + in_section % section_size;
    return {m_blocks - 1 - in_section / section_size, pair % heads, pair / heads};
  }
};

}  // namespace te_jax::cuda::sm90
