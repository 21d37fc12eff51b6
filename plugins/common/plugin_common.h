// Shared plumbing for the attnx TensorRT plugins: data-type and shape helpers, messages that
// name the node, and PluginBase (identity and capabilities of an IPluginV3). The per-op
// boilerplate built on it is the PluginV3 / PluginCreatorV3 template in plugin_v3.h.
//
// The plugins use TensorRT's interfaces only (no TensorRT library is linked) and never call
// IPluginRegistry from inside the library: TensorRT-RTX's registry vtable differs from the
// TensorRT 10.x headers this is compiled against.
#ifndef ATTNX_PLUGIN_COMMON_H
#define ATTNX_PLUGIN_COMMON_H

#include "common/logger.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#if defined(_WIN32)
#define ATTNX_PLUGIN_API __declspec(dllexport)
#else
#define ATTNX_PLUGIN_API __attribute__((visibility("default")))
#endif

namespace attnx
{
namespace plugin
{

constexpr char const* kPluginNamespace = "attnx";
constexpr char const* kPluginVersion = "1";

//! "float32", "float16", "int64", ... for messages.
char const* dataTypeName(nvinfer1::DataType type) noexcept;
//! fp32 / fp16 are the supported floating types.
bool isSupportedFloat(nvinfer1::DataType type) noexcept;
//! ATTNX_DTYPE_* for the kernels' C ABI, -1 if unsupported.
int kernelDtype(nvinfer1::DataType type) noexcept;
//! "[2, 4, -1, 8]".
std::string dimsToString(nvinfer1::Dims const& dims);
//! "attnx::<op> node '<node>': <message>", the form of every plugin message.
std::string nodeMessage(char const* opName, std::string const& nodeName, std::string const& message);

//! Identity, capabilities and node-named messages of one plugin instance.
class PluginBase : public nvinfer1::IPluginV3,
                   public nvinfer1::IPluginV3OneCore,
                   public nvinfer1::IPluginV3OneBuild,
                   public nvinfer1::IPluginV3OneRuntime
{
public:
    PluginBase(char const* opName, std::string nodeName);
    //! A copy (clone) starts with no type error logged yet.
    PluginBase(PluginBase const& other);
    PluginBase& operator=(PluginBase const&) = delete;
    ~PluginBase() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override
    {
        return mOpName;
    }
    char const* getPluginVersion() const noexcept override
    {
        return kPluginVersion;
    }
    char const* getPluginNamespace() const noexcept override
    {
        return kPluginNamespace;
    }

    // IPluginV3OneRuntime
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;

protected:
    //! Log "attnx::<Op> node '<name>': <message>" as an error; returns -1 (a failure status).
    int32_t fail(std::string const& message) const noexcept;
    std::string const& nodeName() const noexcept
    {
        return mNodeName;
    }

    //! Check all floating inputs have one supported type; message on failure.
    int32_t checkInputTypes(nvinfer1::DataType const* types, int32_t nbInputs, char const* const* inputNames) const noexcept;

    //! supportsFormatCombination for "all tensors T (fp32|fp16), linear", except the outputs from
    //! firstInt64Output on (-1: none), which are int64.
    bool supportsFloatAndInt64(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs, int32_t firstInt64Output, char const* const* ioNames) noexcept;

private:
    char const* mOpName;
    std::string mNodeName;
    bool mTypeErrorLogged{false};
};

//! A value of a scalar float PluginField in whatever float/int type the caller used.
bool readScalarField(nvinfer1::PluginField const& field, double& value) noexcept;

//! Build-time view of symbolic dims: constants where known, -1 elsewhere.
nvinfer1::Dims constantDims(nvinfer1::DimsExprs const& exprs) noexcept;

//! Shape-consistency helper over concrete dims where -1 means "unknown" (skipped).
class ShapeChecker
{
public:
    //! rank(dims) == rank, else records "<name> must have rank <rank>, got <dims>".
    bool rank(char const* name, nvinfer1::Dims const& dims, int32_t rank);
    //! a == b when both known, else records "<what>: <aName> is <a> but <bName> is <b>".
    void same(char const* what, char const* aName, int64_t a, char const* bName, int64_t b);
    //! One axis of one input, for sameDims.
    struct Axis
    {
        int32_t input;
        int32_t axis;
    };
    //! All the given axes agree (compared with the first, in order, each as `same`), named
    //! "<names[input]>[<axis>]" in the message.
    void sameDims(char const* what, nvinfer1::Dims const* dims, std::initializer_list<Axis> axes, char const* const* names);
    //! v in {1, other} when both known.
    void oneOr(char const* what, char const* vName, int64_t v, char const* otherName, int64_t other);
    //! v >= minimum when known.
    void atLeast(char const* what, int64_t v, int64_t minimum);
    bool ok() const noexcept
    {
        return mError.empty();
    }
    std::string const& error() const noexcept
    {
        return mError;
    }

private:
    void add(std::string const& message);
    std::string mError;
};

} // namespace plugin
} // namespace attnx

#endif // ATTNX_PLUGIN_COMMON_H
