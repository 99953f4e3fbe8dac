/* mok: a C interface to mok::Layer, for bindings (python/mok uses it through ctypes) and
 * for callers that cannot use C++. Built as the shared library libmok.so (CMake target
 * mok_shared). No CUDA or framework types: tensors are pointers with a dtype, a device, a
 * shape and strides, as mok::TensorView.
 *
 * Every call that can fail returns a status (MOK_OK, or MOK_ERROR / MOK_PEER_WAIT_ERROR with
 * the message in mok_last_error(), as mok::Error / mok::PeerWaitError would say it); none
 * throws or aborts. The structs are plain data: a binding mirrors them field for field, and
 * MOK_C_ABI_VERSION changes whenever one of them, or the set of functions, does.
 */
#ifndef MOK_C_API_H
#define MOK_C_API_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#define MOK_C_ABI_VERSION 4
#define MOK_C_MAX_DIMS 4
#define MOK_C_MAX_SHARED 8

enum mok_status { MOK_OK = 0, MOK_ERROR = 1, MOK_PEER_WAIT_ERROR = 4 };
/* mok::DType, mok::Device, mok::Precision, mok::Backend and mok::EpMode, in their order. */
enum mok_dtype { MOK_BF16 = 0, MOK_F32 = 1, MOK_I32 = 2, MOK_I64 = 3, MOK_E4M3 = 4, MOK_E8M0 = 5 };
enum mok_device { MOK_CPU = 0, MOK_CUDA = 1 };
enum mok_precision { MOK_PRECISION_BF16 = 0, MOK_PRECISION_MXFP8 = 1 };
enum mok_backend { MOK_BACKEND_CPU = 0, MOK_BACKEND_CUDA = 1 };
enum mok_ep_mode { MOK_ALL_RANKS = 0, MOK_RANK_SLICE = 1, MOK_DISTRIBUTED = 2 };

/* A tensor; data == NULL means "none" (an empty view). Strides are in elements. */
typedef struct mok_tensor {
  void* data;
  int32_t dtype;
  int32_t device;
  int32_t device_index;
  int32_t ndim;
  int64_t shape[MOK_C_MAX_DIMS];
  int64_t strides[MOK_C_MAX_DIMS];
} mok_tensor;

typedef struct mok_problem {
  int32_t num_experts, hidden, intermediate, top_k, ep_size, tokens_per_rank;
  int32_t precision;
  int32_t num_shared;
  int32_t shared_intermediate[MOK_C_MAX_SHARED];
  int32_t has_swiglu_limit;  /* 0 or 1 (anything else is an error naming the field) */
  float swiglu_limit;
} mok_problem;

/* mok::Config; mok_default_config() fills it with the library's defaults. */
typedef struct mok_config {
  int32_t minibatch_rows, macrobatch_rows;
  double schedule_capacity_factor;
  int32_t forward_comm_sms, backward_comm_sms, tile_rows, task_band_tiles;
  int32_t task_pairs; /* 0 or 1 (anything else is an error naming the field) */
} mok_config;

typedef struct mok_options {
  int32_t backend, ep_mode, active_rank, cpu_threads, cuda_device;
  void* cuda_stream; /* a cudaStream_t; NULL: the default stream. Must outlive the layer (its destroy waits on it) */
} mok_options;

/* One shared expert's weights and gradients. */
typedef struct mok_shared_weights {
  mok_tensor w_gate, w_up, w_down;
} mok_shared_weights;

typedef struct mok_rank_forward {
  mok_tensor x, top_experts, router_weights;
  mok_tensor w_gate, w_up, w_down;
  int32_t num_shared;
  mok_shared_weights shared[MOK_C_MAX_SHARED];
  mok_tensor y;
} mok_rank_forward;

typedef struct mok_rank_backward {
  mok_tensor x, top_experts, router_weights;
  mok_tensor w_gate, w_up, w_down;
  int32_t num_shared;
  mok_shared_weights shared[MOK_C_MAX_SHARED];
  mok_tensor dy, dx, d_router_weights, d_w_gate, d_w_up, d_w_down;
  mok_shared_weights d_shared[MOK_C_MAX_SHARED]; /* w_gate/w_up/w_down hold the gradients */
} mok_rank_backward;

typedef struct mok_layer mok_layer;

int mok_c_abi_version(void);
/* The message of this thread's last failed call ("" when none failed yet). The pointer is
 * valid until this thread's next failed call: copy the message before calling again. */
const char* mok_last_error(void);
/* 1 when the cuda backend is built and sees a GPU it runs on (Hopper, sm_90); 0 otherwise,
 * also when asking failed (mok_last_error() then says why). */
int mok_cuda_available(void);
/* mok::version() and mok::build_commit(): static strings. */
const char* mok_version(void);
const char* mok_build_commit(void);
/* Fills *config with the library's defaults; NULL is ignored. */
void mok_default_config(mok_config* config);

/* The named shapes (MoK's four, the single-GPU ones, test shapes): how many there are, or
 * -1 if listing them failed (mok_last_error() then says why); and the name at `index` in
 * [0, mok_shape_count()), NULL for any other index or on that failure. */
int32_t mok_shape_count(void);
const char* mok_shape_name(int32_t index);
/* mok::problem_from_shape: the shape `name` at `ep_size` ranks of `tokens_per_rank` tokens
 * (0: the shape's own defaults; negative values are errors). The problem is validated: one
 * that breaks a rule (E not a multiple of ep_size, say) is an error naming it. */
int mok_problem_from_shape(const char* name, int32_t ep_size, int32_t tokens_per_rank, mok_problem* problem);

/* Builds a layer (mok::Layer's constructor; collective in MOK_DISTRIBUTED mode); `config`
 * NULL: the library's defaults. *layer is set to NULL first, so it holds no stale handle
 * after an error. Calls on one layer from
 * several threads run one at a time; destroying a layer while another thread calls it is the
 * caller's error. */
int mok_layer_create(const mok_problem* problem, const mok_config* config, const mok_options* options,
                     mok_layer** layer);
/* Destroys it; NULL is ignored. In MOK_DISTRIBUTED mode this is collective, as mok::Layer's
 * destructor is: it waits for its queued work at most the group's wait limit (then aborts the
 * communicator), then meets the peers within the group's start-up limit (aborting when one
 * does not come: it aborted, or never destroys its layer) and tears the communicator down
 * with them. */
void mok_layer_destroy(mok_layer* layer);
/* Destroys it after a failure on this rank, as mok::Layer is destroyed while an exception
 * propagates: a distributed group's communicator is aborted (mok_layer_abandon_group), so
 * nothing waits for peers. */
void mok_layer_destroy_after_error(mok_layer* layer);
/* mok::Layer::abandon_group: a distributed layer's rank gives up on its group (its
 * communicator is aborted, later calls fail saying why, destroying it waits for no peer);
 * without a group nothing changes. `why` may be NULL. A call on the layer in progress on
 * another thread finishes first (calls run one at a time): it cannot interrupt one. */
int mok_layer_abandon_group(mok_layer* layer, const char* why);
/* mok::Layer::group_aborted, into *aborted (1 or 0). */
int mok_layer_group_aborted(const mok_layer* layer, int32_t* aborted);
/* mok::Layer::forward / backward (backward: the cpu backend only, for now) over `num_ranks` entries
 * (mok::Layer's rules on which);
 * num_ranks is checked against the layer before any entry of `ranks` is read. */
int mok_layer_forward(mok_layer* layer, const mok_rank_forward* ranks, int32_t num_ranks);
int mok_layer_backward(mok_layer* layer, const mok_rank_backward* ranks, int32_t num_ranks);
int mok_layer_synchronize(mok_layer* layer);
/* mok::Layer::combine_slots: rank `rank`'s combine slots, bf16 [T*k, H], in the layer's
 * memory; a rank slice's other ranks' rows are written here. On either backend the memory
 * lasts as long as the layer (on the cpu backend, from its first forward on). Each forward
 * rewrites it, so a forward refuses it, or any part of it, as an argument. On the cpu
 * backend, after a forward that failed part way (out of host memory) it is an error until a
 * forward succeeds (the slots hold part of that forward's rows). */
int mok_layer_combine_slots(const mok_layer* layer, int32_t rank, mok_tensor* slots);
/* The config the layer runs with, the library's choices filled in. */
int mok_layer_config(const mok_layer* layer, mok_config* config);

#ifdef __cplusplus
}
#endif

#endif /* MOK_C_API_H */
