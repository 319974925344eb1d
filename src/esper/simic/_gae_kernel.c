/*
 * GAE on the CPU in one pass over memory: esper.simic._gae_kernel.
 *
 * Why C: the recursion A_t = delta_t + c_t * A_{t+1} runs along the contiguous axis of
 * the [n_envs, T] buffers. Tensor ops can only vectorise it across envs, which costs
 * either one small kernel per step or re-laying the data out time-major and back, and on
 * a CPU those copies cost more than the arithmetic. Walking each env's row backwards in
 * a plain loop reads every input once and writes every output once.
 *
 * The Python wrapper (esper/simic/gae_native.py) checks shapes, dtypes, devices and
 * contiguity and owns the output tensors; this file trusts the pointers it is given.
 * Float32 inputs are accumulated in double, so the result is the float32 rounding of the
 * exact recursion, not a float32 chain of T roundings.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define DEFINE_SOLVE(NAME, REAL)                                                           \
    static void NAME(const REAL *rewards, const REAL *values, const REAL *next_values,     \
                     const uint8_t *terminated, const uint8_t *done, REAL *advantages,     \
                     REAL *returns, int64_t n_envs, int64_t n_steps, double gamma,         \
                     double decay)                                                         \
    {                                                                                      \
        for (int64_t env = 0; env < n_envs; ++env) {                                       \
            const int64_t row = env * n_steps;                                             \
            double following = 0.0;                                                        \
            for (int64_t t = n_steps - 1; t >= 0; --t) {                                   \
                const int64_t i = row + t;                                                 \
                const double value = (double)values[i];                                    \
                const double bootstrap = terminated[i] ? 0.0 : gamma * (double)next_values[i]; \
                const double delta = (double)rewards[i] + bootstrap - value;               \
                following = (done[i] || terminated[i]) ? delta : delta + decay * following; \
                advantages[i] = (REAL)following;                                           \
                returns[i] = (REAL)(following + value);                                    \
            }                                                                              \
        }                                                                                  \
    }

DEFINE_SOLVE(solve_float32, float)
DEFINE_SOLVE(solve_float64, double)

static PyObject *solve(PyObject *self, PyObject *args)
{
    unsigned long long rewards, values, next_values, terminated, done, advantages, returns;
    long long n_envs, n_steps;
    double gamma, gae_lambda;
    int is_double;
    (void)self;
    if (!PyArg_ParseTuple(args, "KKKKKKKLLddp", &rewards, &values, &next_values, &terminated,
                          &done, &advantages, &returns, &n_envs, &n_steps, &gamma, &gae_lambda,
                          &is_double)) {
        return NULL;
    }
    if (n_envs < 0 || n_steps < 0) {
        PyErr_SetString(PyExc_ValueError, "_gae_kernel.solve: negative n_envs or n_steps");
        return NULL;
    }
    const double decay = gamma * gae_lambda;
    Py_BEGIN_ALLOW_THREADS
    if (is_double) {
        solve_float64((const double *)(uintptr_t)rewards, (const double *)(uintptr_t)values,
                      (const double *)(uintptr_t)next_values,
                      (const uint8_t *)(uintptr_t)terminated, (const uint8_t *)(uintptr_t)done,
                      (double *)(uintptr_t)advantages, (double *)(uintptr_t)returns, n_envs,
                      n_steps, gamma, decay);
    } else {
        solve_float32((const float *)(uintptr_t)rewards, (const float *)(uintptr_t)values,
                      (const float *)(uintptr_t)next_values,
                      (const uint8_t *)(uintptr_t)terminated, (const uint8_t *)(uintptr_t)done,
                      (float *)(uintptr_t)advantages, (float *)(uintptr_t)returns, n_envs,
                      n_steps, gamma, decay);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"solve", solve, METH_VARARGS,
     "solve(rewards, values, next_values, terminated, done, advantages, returns, n_envs, "
     "n_steps, gamma, gae_lambda, is_double): addresses of contiguous [n_envs, n_steps] "
     "buffers (bool flags as bytes); fills advantages and returns. Unchecked: call it "
     "through esper.simic.gae_native."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    "_gae_kernel",
    "GAE on the CPU in one pass over memory (see esper.simic.gae_native).",
    -1,
    methods,
    NULL,
    NULL,
    NULL,
    NULL,
};

PyMODINIT_FUNC PyInit__gae_kernel(void) { return PyModule_Create(&module); }
