// Shared plugin plumbing and the library's entry points for IPluginRegistry::loadLibrary.
#include "plugin_common.h"

#include "attnx_kernels.h"
#include "maw_depth_select_plugin.h"
#include "tta_distance_plugin.h"

#include <cstdio>
#include <cstring>
#include <deque>
#include <dlfcn.h>
#include <mutex>
#include <sstream>

namespace attnx
{
namespace plugin
{

// TensorRT-RTX's logger interface, as its Python bindings' vtables show: IVersionedInterface
// (getAPILanguage, getInterfaceInfo, destructors), then log. Only called after
// getInterfaceInfo() reports kind "ILogger". (Not in an anonymous namespace: GCC would see
// that nothing implements it and devirtualize the call into __cxa_pure_virtual.)
class RtxLogger : public nvinfer1::IVersionedInterface
{
public:
    virtual void log(nvinfer1::ILogger::Severity severity, char const* msg) noexcept = 0;

protected:
    ~RtxLogger() noexcept override = default;
};

namespace
{

// How to talk to the logger of the TensorRT library that loaded us.
enum class LoggerAbi
{
    kUnresolved,
    kHeader,    // TensorRT 10.x: ILogger as in the headers we compile against (log is the first virtual).
    kVersioned, // TensorRT-RTX 1.x: v_1_0::ILogger derives from IVersionedInterface (see RtxLogger).
    kNone,      // unknown library: stderr only
};

using GetLoggerFn = void* (*) ();
using GetMajorFn = int32_t (*)();

std::mutex gLoggerMutex;
nvinfer1::ILoggerFinder* gLoggerFinder{nullptr};
GetLoggerFn gGetLogger{nullptr};
LoggerAbi gAbi{LoggerAbi::kUnresolved};

constexpr size_t kMaxKeptErrors = 64;
std::mutex gErrorsMutex;
std::deque<std::string> gErrors;

// Which TensorRT handed us the finder: the library holding the finder's vtable. Its exported
// C functions getInferLibMajorVersion() and getLogger() are looked up there only (never by a
// global symbol search). TensorRT-RTX 1.7's ILoggerFinder::findLogger always returns null, so
// getLogger() (the logger of the current builder/runtime) is the fallback. Holds gLoggerMutex.
void resolveLoggerAbi()
{
    if (gAbi != LoggerAbi::kUnresolved)
    {
        return;
    }
    gAbi = LoggerAbi::kNone;
    if (gLoggerFinder == nullptr)
    {
        return;
    }
    Dl_info info{};
    void const* vtable = *reinterpret_cast<void const* const*>(gLoggerFinder);
    if (dladdr(vtable, &info) == 0 || info.dli_fname == nullptr)
    {
        return;
    }
    void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr)
    {
        return;
    }
    gGetLogger = reinterpret_cast<GetLoggerFn>(dlsym(handle, "getLogger"));
    auto const getMajor = reinterpret_cast<GetMajorFn>(dlsym(handle, "getInferLibMajorVersion"));
    std::string const path = info.dli_fname;
    if (path.find("tensorrt_rtx") != std::string::npos)
    {
        gAbi = LoggerAbi::kVersioned;
    }
    else if (getMajor != nullptr && getMajor() == NV_TENSORRT_MAJOR)
    {
        gAbi = LoggerAbi::kHeader;
    }
}

bool logThrough(void* logger, LoggerAbi abi, nvinfer1::ILogger::Severity severity, char const* msg)
{
    if (logger == nullptr)
    {
        return false;
    }
    if (abi == LoggerAbi::kHeader)
    {
        static_cast<nvinfer1::ILogger*>(logger)->log(severity, msg);
        return true;
    }
    if (abi == LoggerAbi::kVersioned)
    {
        auto* versioned = static_cast<RtxLogger*>(logger);
        nvinfer1::InterfaceInfo const iface = versioned->getInterfaceInfo();
        if (iface.kind != nullptr && std::strcmp(iface.kind, "ILogger") == 0)
        {
            versioned->log(severity, msg);
            return true;
        }
    }
    return false;
}

void keepError(std::string const& message)
{
    std::lock_guard<std::mutex> lock(gErrorsMutex);
    if (gErrors.size() >= kMaxKeptErrors)
    {
        gErrors.pop_front();
    }
    gErrors.push_back(message);
}

} // namespace

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    std::lock_guard<std::mutex> lock(gLoggerMutex);
    gLoggerFinder = finder;
    gGetLogger = nullptr;
    gAbi = LoggerAbi::kUnresolved;
}

void log(nvinfer1::ILogger::Severity severity, std::string const& message) noexcept
{
    bool const isError = severity <= nvinfer1::ILogger::Severity::kERROR;
    bool logged{false};
    try
    {
        if (isError)
        {
            keepError(message);
        }
        void* logger{nullptr};
        LoggerAbi abi{LoggerAbi::kNone};
        {
            // Find the logger under the lock, call it outside (it may take the Python GIL).
            std::lock_guard<std::mutex> lock(gLoggerMutex);
            resolveLoggerAbi();
            abi = gAbi;
            if (abi != LoggerAbi::kNone)
            {
                logger = gLoggerFinder != nullptr ? static_cast<void*>(gLoggerFinder->findLogger()) : nullptr;
                if (logger == nullptr && gGetLogger != nullptr)
                {
                    logger = gGetLogger();
                }
            }
        }
        logged = logThrough(logger, abi, severity, message.c_str());
    }
    catch (...)
    {
        logged = false;
    }
    if (!logged && severity <= nvinfer1::ILogger::Severity::kWARNING)
    {
        std::fprintf(stderr, "[attnx plugins] %s\n", message.c_str());
    }
}

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
        std::string const node = mNodeName.empty() ? std::string("<unnamed>") : mNodeName;
        log(nvinfer1::ILogger::Severity::kERROR,
            std::string(kPluginNamespace) + "::" + mOpName + " node '" + node + "': " + message);
    }
    catch (...)
    {
    }
    return -1;
}

bool PluginBase::reject(std::string const& message) const noexcept
{
    fail(message);
    return false;
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

// ---------------------------------------------------------------------------------- library entry points

extern "C" ATTNX_PLUGIN_API void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    attnx::plugin::setLoggerFinder(finder);
}

// The plugins' recent error messages (newest last, one per line), for callers whose TensorRT
// logger does not show them. Returns the full length; copies at most size-1 bytes plus NUL.
extern "C" ATTNX_PLUGIN_API size_t attnx_plugins_errors(char* buffer, size_t size)
{
    std::string all;
    {
        std::lock_guard<std::mutex> lock(attnx::plugin::gErrorsMutex);
        for (auto const& e : attnx::plugin::gErrors)
        {
            all += e;
            all += '\n';
        }
    }
    if (buffer != nullptr && size > 0)
    {
        size_t const n = all.size() < size - 1 ? all.size() : size - 1;
        std::memcpy(buffer, all.data(), n);
        buffer[n] = '\0';
    }
    return all.size();
}

extern "C" ATTNX_PLUGIN_API void attnx_plugins_clear_errors(void)
{
    std::lock_guard<std::mutex> lock(attnx::plugin::gErrorsMutex);
    attnx::plugin::gErrors.clear();
}

extern "C" ATTNX_PLUGIN_API nvinfer1::IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
{
    static attnx::plugin::MawDepthSelectCreator mawCreator;
    static attnx::plugin::TtaDistanceCreator ttaCreator;
    static nvinfer1::IPluginCreatorInterface* const creators[] = {&mawCreator, &ttaCreator};
    nbCreators = static_cast<int32_t>(sizeof(creators) / sizeof(creators[0]));
    return creators;
}
