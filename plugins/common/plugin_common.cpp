// Shared plugin plumbing (plugin_common.h): type names, dims, shape checks, PluginBase.
#include "common/plugin_common.h"

#include "common/kernel_abi.h"

#include <sstream>
#include <utility>

namespace attnx
{
namespace plugin
{

char const* dataTypeName(nvinfer1::DataType type) noexcept
{
    using nvinfer1::DataType;
    switch (type)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kINT8: return "int8";
    case DataType::kINT32: return "int32";
    case DataType::kBOOL: return "bool";
    case DataType::kUINT8: return "uint8";
    case DataType::kFP8: return "fp8";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT64: return "int64";
    case DataType::kINT4: return "int4";
    default: return "an unknown type";
    }
}

bool isSupportedFloat(nvinfer1::DataType type) noexcept
{
    return type == nvinfer1::DataType::kFLOAT || type == nvinfer1::DataType::kHALF;
}

int kernelDtype(nvinfer1::DataType type) noexcept
{
    switch (type)
    {
    case nvinfer1::DataType::kFLOAT: return ATTNX_DTYPE_FP32;
    case nvinfer1::DataType::kHALF: return ATTNX_DTYPE_FP16;
    default: return -1;
    }
}

std::string nodeMessage(char const* opName, std::string const& nodeName, std::string const& message)
{
    std::string const node = nodeName.empty() ? std::string("<unnamed>") : nodeName;
    return std::string(kPluginNamespace) + "::" + opName + " node '" + node + "': " + message;
}

std::string dimsToString(nvinfer1::Dims const& dims)
{
    std::ostringstream s;
    s << "[";
    for (int32_t i = 0; i < dims.nbDims; ++i)
    {
        s << (i ? ", " : "") << dims.d[i];
    }
    s << "]";
    return s.str();
}

nvinfer1::Dims constantDims(nvinfer1::DimsExprs const& exprs) noexcept
{
    nvinfer1::Dims dims{};
    dims.nbDims = exprs.nbDims;
    for (int32_t i = 0; i < exprs.nbDims && i < nvinfer1::Dims::MAX_DIMS; ++i)
    {
        auto const* e = exprs.d[i];
        dims.d[i] = (e != nullptr && e->isConstant()) ? e->getConstantValue() : -1;
    }
    return dims;
}

// ------------------------------------------------------------------------------------ ShapeChecker

void ShapeChecker::add(std::string const& message)
{
    if (!mError.empty())
    {
        mError += "; ";
    }
    mError += message;
}

bool ShapeChecker::rank(char const* name, nvinfer1::Dims const& dims, int32_t rank)
{
    if (dims.nbDims != rank)
    {
        add(std::string(name) + " must have rank " + std::to_string(rank) + ", got rank "
            + std::to_string(dims.nbDims) + " " + dimsToString(dims));
        return false;
    }
    return true;
}

void ShapeChecker::same(char const* what, char const* aName, int64_t a, char const* bName, int64_t b)
{
    if (a >= 0 && b >= 0 && a != b)
    {
        add(std::string(what) + " differs: " + aName + " is " + std::to_string(a) + " but " + bName + " is "
            + std::to_string(b));
    }
}

void ShapeChecker::sameDims(
    char const* what, nvinfer1::Dims const* dims, std::initializer_list<Axis> axes, char const* const* names)
{
    auto const label = [&](Axis a) { return std::string(names[a.input]) + "[" + std::to_string(a.axis) + "]"; };
    Axis const first = *axes.begin();
    for (auto it = axes.begin() + 1; it != axes.end(); ++it)
    {
        same(what, label(first).c_str(), dims[first.input].d[first.axis], label(*it).c_str(), dims[it->input].d[it->axis]);
    }
}

void ShapeChecker::oneOr(char const* what, char const* vName, int64_t v, char const* otherName, int64_t other)
{
    if (v >= 0 && other >= 0 && v != 1 && v != other)
    {
        add(std::string(what) + ": " + vName + " is " + std::to_string(v) + " but must be 1 or " + otherName + " ("
            + std::to_string(other) + ")");
    }
}

void ShapeChecker::atLeast(char const* what, int64_t v, int64_t minimum)
{
    if (v >= 0 && v < minimum)
    {
        add(std::string(what) + " is " + std::to_string(v) + " but must be at least " + std::to_string(minimum));
    }
}

// ------------------------------------------------------------------------------------ PluginBase

PluginBase::PluginBase(char const* opName, std::string nodeName)
    : mOpName(opName)
    , mNodeName(std::move(nodeName))
{
}

PluginBase::PluginBase(PluginBase const& other)
    : mOpName(other.mOpName)
    , mNodeName(other.mNodeName)
{
}

nvinfer1::IPluginCapability* PluginBase::getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case nvinfer1::PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case nvinfer1::PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case nvinfer1::PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

nvinfer1::IPluginV3* PluginBase::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    return clone();
}

int32_t PluginBase::fail(std::string const& message) const noexcept
{
    try
    {
        log(nvinfer1::ILogger::Severity::kERROR, nodeMessage(mOpName, mNodeName, message));
    }
    catch (...)
    {
    }
    return -1;
}

int32_t PluginBase::checkInputTypes(
    nvinfer1::DataType const* types, int32_t nbInputs, char const* const* inputNames) const noexcept
{
    if (types == nullptr || nbInputs < 1)
    {
        return fail("no input types given");
    }
    for (int32_t i = 0; i < nbInputs; ++i)
    {
        if (!isSupportedFloat(types[i]))
        {
            return fail(std::string("input '") + inputNames[i] + "' is " + dataTypeName(types[i])
                + "; supported: float32 or float16");
        }
        if (types[i] != types[0])
        {
            return fail(std::string("inputs must share one type, but '") + inputNames[0] + "' is "
                + dataTypeName(types[0]) + " and '" + inputNames[i] + "' is " + dataTypeName(types[i]));
        }
    }
    return 0;
}

bool PluginBase::supportsFloatAndInt64(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
    int32_t nbOutputs, int32_t firstInt64Output, char const* const* ioNames) noexcept
{
    if (inOut == nullptr || pos < 0 || pos >= nbInputs + nbOutputs)
    {
        return false;
    }
    auto const& desc = inOut[pos].desc;
    if (desc.format != nvinfer1::TensorFormat::kLINEAR)
    {
        return false;
    }
    bool const isInt64Output = firstInt64Output >= 0 && pos >= nbInputs + firstInt64Output;
    bool ok{false};
    std::string why;
    if (isInt64Output)
    {
        ok = desc.type == nvinfer1::DataType::kINT64;
        if (!ok)
        {
            why = std::string("output '") + ioNames[pos] + "' must be int64, got " + dataTypeName(desc.type);
        }
    }
    else if (pos == 0)
    {
        ok = isSupportedFloat(desc.type);
        if (!ok)
        {
            why = std::string("input '") + ioNames[0] + "' is " + dataTypeName(desc.type)
                + "; supported: float32 or float16";
        }
    }
    else
    {
        ok = desc.type == inOut[0].desc.type;
        if (!ok && isSupportedFloat(inOut[0].desc.type))
        {
            why = std::string("'") + ioNames[pos] + "' is " + dataTypeName(desc.type) + " but '" + ioNames[0]
                + "' is " + dataTypeName(inOut[0].desc.type) + " (one type for all float tensors)";
        }
    }
    if (!ok && !why.empty() && !mTypeErrorLogged)
    {
        // TensorRT also probes combinations it does not use; log each instance's first real type problem once.
        mTypeErrorLogged = true;
        fail(why);
    }
    return ok;
}

bool readScalarField(nvinfer1::PluginField const& field, double& value) noexcept
{
    if (field.data == nullptr || field.length < 1)
    {
        return false;
    }
    using nvinfer1::PluginFieldType;
    switch (field.type)
    {
    case PluginFieldType::kFLOAT32: value = *static_cast<float const*>(field.data); return true;
    case PluginFieldType::kFLOAT64: value = *static_cast<double const*>(field.data); return true;
    case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(field.data); return true;
    case PluginFieldType::kINT64: value = static_cast<double>(*static_cast<int64_t const*>(field.data)); return true;
    default: return false;
    }
}

} // namespace plugin
} // namespace attnx
